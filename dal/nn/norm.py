"""Normalisation layers as the NPU runs them, when no Conv2d absorbs them.

* :class:`QBatchNorm2d` — a BatchNorm2d that cannot be folded (it does not directly follow a
  conv called once in a traced forward: a stem ``bn1`` whose parent does not trace, DenseNet's
  pre-activation BN). In inference it is a per-channel affine ``y = a*x + b`` with
  ``a = gamma / sqrt(var + eps)`` and ``b = beta - mean * a``: exactly a depthwise 1x1
  convolution, which every integer NPU runs. So it is trained and exported as one: quantized
  input, int8 per-channel weight ``a`` (shape ``[C, 1, 1, 1]``, ``groups=C``), int32 bias ``b``
  with ``scale = s_in * s_a``. In training the statistics are the batch's (of the quantized
  input) and the running statistics are updated as BatchNorm2d does, so the user's loop is
  unchanged; in eval the running statistics are used.
* :class:`Fp16GroupNorm`, :class:`Fp16InstanceNorm2d` — GroupNorm / InstanceNorm on hardware
  with an FP16 vector engine: input, weight, bias and output rounded to FP16 (the
  ``FakeQuantizer("fp16")`` cast round trip), the normalisation in between. The exporter
  writes them between Cast nodes; torch exports GroupNorm as InstanceNormalization -> Mul ->
  Add, which dal.npu runs (``dal.npu.ops_dense``).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.fold_factor import fold_factor
from ..quantizer import FakeQuantizer
from .base import QATModule


class QBatchNorm2d(QATModule, nn.BatchNorm2d):
    """``finish(conv2d(fq_in(x), fq_w(a[:, None, None, None]), fq_bias(b), groups=C))``, with
    ``a = gamma / sqrt(var + eps)`` and ``b = beta - mean * a`` (batch statistics in training,
    running statistics in eval); same Parameter and buffer objects as the BatchNorm2d."""

    op_class = "conv"
    # the depthwise 1x1 convolution it is exported as, in a Conv2d's terms (dal.convert reads these)
    stride, padding, dilation, padding_mode = (1, 1), (0, 0), (1, 1), "zeros"

    @property
    def groups(self) -> int:
        return self.num_features

    def folded_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exported depthwise conv's float weight ``a[:, None, None, None]`` and bias ``b``, from
        the running statistics (inference form; ValueError without them)."""
        if self.running_mean is None:
            raise ValueError(f"{self.qat_name}: no running statistics, so no fixed per-channel affine")
        a, b = self.per_channel_affine(self.running_mean, self.running_var)
        return a.reshape(-1, 1, 1, 1), b

    def _stats(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self.training or self.running_mean is None):
            return self.running_mean, self.running_var
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False)
        if self.training and self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                n = x.numel() / x.shape[1]
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * (n / max(n - 1, 1)), alpha=m)
        return mean, var

    def per_channel_affine(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` of ``y = a*x + b`` for the given statistics; ``a = gamma / sqrt(var + eps)`` with
        each operation correctly rounded, as QConvBn2d's fold factor (``dal.formats.fold_factor``)."""
        beta = self.bias if self.bias is not None else torch.zeros_like(mean)
        a = fold_factor(self.weight, var, self.eps)
        return a, beta - mean * a

    def forward(self, x):
        if self.input_quant is not None:
            x = self.input_quant(x)
        a, b = self.per_channel_affine(*self._stats(x))
        w, bias = self.quantized_weight(a.reshape(-1, 1, 1, 1)), self.quantized_bias(b)
        if torch.jit.is_tracing():  # the exporter writes the depthwise 1x1 Conv the NPU runs
            return self.finish(F.conv2d(x, w, bias, groups=x.shape[1]))
        # The same product plus bias as a broadcast (to float32 rounding: torch's conv may round the
        # product first): its CPU conv runs groups=C as C one-channel convs, forward and backward.
        return self.finish(torch.addcmul(bias.reshape(1, -1, 1, 1), x, w.reshape(1, -1, 1, 1)))

    def extra_repr(self):
        return f"{nn.BatchNorm2d.extra_repr(self)}, as a per-channel affine (depthwise 1x1), {self.qat_extra_repr()}"


class _Fp16Norm(QATModule):
    """FP16 cast round trips on input, weight, bias and output around the float normalisation."""

    op_class = "norm"

    @classmethod
    def from_float(cls, mod: nn.Module, spec=None, name: str = "", activation=None) -> "QATModule":
        from .adopt import adopt

        q = adopt(cls, mod)
        q.qat_name, q.activation, q.bias_mode = name, None, "float"
        q.input_quant = FakeQuantizer("fp16", name=f"{name}.input_quant")
        q.weight_quant = FakeQuantizer("fp16", name=f"{name}.weight_quant") if q.weight is not None else None
        q.bias_quant = FakeQuantizer("fp16", name=f"{name}.bias_quant") if q.bias is not None else None
        q.output_quant = FakeQuantizer("fp16", name=f"{name}.output_quant")
        return q  # identities until dal.calibrate moves them on, like every quantizer

    def to_float(self) -> nn.Module:
        from .adopt import release

        return release(self, drop=("bias_quant",))

    def quantizers(self) -> dict:
        return {k: quant for k in ("input_quant", "weight_quant", "bias_quant", "output_quant")
                if (quant := getattr(self, k, None)) is not None}

    def _wb(self):
        w = self.weight_quant(self.weight) if self.weight is not None else None
        b = self.bias_quant(self.bias) if self.bias is not None else None
        return w, b


class Fp16GroupNorm(_Fp16Norm, nn.GroupNorm):
    """``q_out(group_norm(q_in(x), q_w(gamma), q_b(beta)))`` with FP16 round trips."""

    def forward(self, x):
        w, b = self._wb()
        return self.output_quant(F.group_norm(self.input_quant(x), self.num_groups, w, b, self.eps))


class Fp16InstanceNorm2d(_Fp16Norm, nn.InstanceNorm2d):
    """``q_out(instance_norm(q_in(x), ...))`` with FP16 round trips (running stats as the original)."""

    def forward(self, x):
        w, b = self._wb()
        use_input_stats = self.training or not self.track_running_stats
        return self.output_quant(F.instance_norm(self.input_quant(x), self.running_mean, self.running_var, w, b,
                                                 use_input_stats, self.momentum or 0.0, self.eps))


def fp16_norms() -> dict:
    """Float normalisation type -> the FP16 module prepare builds for it on FP16 hardware: every
    module type of a registered float op (:mod:`dal.ops`) whose ``qat_module`` is one of this file's FP16
    norms (nn.GroupNorm -> Fp16GroupNorm, nn.InstanceNorm2d -> Fp16InstanceNorm2d), in
    registration order. Read again when an op is registered or unregistered."""
    from ..ops import version

    return dict(_fp16_norms(version()))


@functools.cache
def _fp16_norms(_version: int) -> tuple:
    from ..ops import all_ops

    pairs = []
    for op in all_ops():
        qat = op.resolve("qat_module") if op.handling == "float" and op.qat_module is not None else None
        if isinstance(qat, type) and issubclass(qat, _Fp16Norm):
            pairs += [(t, qat) for t in op.modules]
    return tuple(pairs)


@functools.cache
def batch_norm_types() -> tuple:
    """The batch norms of any rank (nn.BatchNorm1d / 2d / 3d): the module types of dal's own ops
    (:func:`dal.hardware.op_classes.dal_ops`) whose export pattern is an ONNX
    ``BatchNormalization`` (a per-channel affine from running statistics, foldable into the
    weighted layer before it)."""
    from ..hardware.op_classes import dal_ops

    return tuple(t for op in dal_ops() if "BatchNormalization" in op.onnx for t in op.modules)


def __getattr__(name: str):
    """``FP16_NORMS``: :func:`fp16_norms`, derived from dal.ops when read."""
    if name == "FP16_NORMS":
        return fp16_norms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
