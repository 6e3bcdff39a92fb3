"""What every QAT module shares: the ``QATModule`` base (its quantizers, ``from_float`` /
``to_float``), the int32 bias convention, fused activations."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import INT32, Granularity, fake_quantize
from ..formats.bias import bias_fake_quantize
from ..quantizer import FakeQuantizer
from .adopt import adopt, release
from .spec import make_quantizer, per_channel_variant, role_specs


def apply_activation(y: torch.Tensor, activation, inplace: bool = False) -> torch.Tensor:
    """Fused output activation: None, "relu", "relu6" or ("clip", lo, hi).

    ``inplace``: the caller owns ``y`` (its own fresh result, read by nothing else and saved by no
    autograd node), and "relu" overwrites it (``F.relu_``): the same values, and the same gradient,
    as torch's ReLU backward reads the result in both forms. The other activations stay out of
    place (their in-place forms' backward would copy the input first, or read the clipped result)."""
    if activation is None:
        return y
    if activation == "relu":
        return F.relu_(y) if inplace else F.relu(y)
    if activation == "relu6":
        return F.hardtanh(y, 0.0, 6.0)
    if isinstance(activation, tuple) and activation[0] == "clip":
        return torch.clamp(y, activation[1], activation[2])
    raise ValueError(f"activation={activation!r} is not one of None, 'relu', 'relu6', ('clip', lo, hi)")


def _active_integer(q: Optional[FakeQuantizer]) -> bool:
    return q is not None and q.fmt.is_integer and q.state in ("quantize", "frozen") and q.initialized


class QATModule(nn.Module):
    """The base of every QAT module: dal.nn's drop-ins and the modules dal.replace builds.

    Membership is ``isinstance(mod, QATModule)``. Each has ``qat_name`` (its module path, for
    errors and export names), ``quantizers()`` (role -> FakeQuantizer), and ``to_float()``
    (the float module, same Parameter objects); swapped modules are built with the classmethod
    ``from_float(mod, spec, name)``. The drop-ins inherit it before their torch class
    (``class QLinear(QATModule, nn.Linear)``), so ``nn.Linear``'s constructor and state apply.

    Attributes: ``input_quant``, ``weight_quant``, ``output_quant`` (FakeQuantizer or None),
    ``activation`` (fused, applied before ``output_quant``), ``bias_mode`` ("int32" or "float").

    Bias convention (the one integer hardware uses, and the exporter writes): when input and
    weight are integer-quantized, the bias is fake-quantized to int32 with
    ``scale = float32(s_in) * float32(s_w)`` (per output channel when the weight is), zero point 0.
    """

    qat_name: str = ""
    #: built from a float module that ``to_float`` gives back (False: a module prepare added,
    #: such as QAdd, which the rewritten forward calls; to undo it, turn its quantizers off)
    swappable = True
    # Annotations only: a class-level default would shadow the submodules nn.Module keeps in _modules.
    input_quant: Optional[FakeQuantizer]
    weight_quant: Optional[FakeQuantizer]
    output_quant: Optional[FakeQuantizer]
    #: axis of the weight that indexes output channels (per-channel scales), and the reduction axis
    weight_channel_axis = 0
    weight_reduction_axis = 1

    @classmethod
    def from_float(cls, mod: nn.Module, spec=None, name: str = "", activation=None) -> "QATModule":
        """The QAT module of float ``mod`` for a recipe ``LayerSpec``: same Parameter objects,
        plus the quantizers the spec asks for, named ``<name>.input_quant`` etc."""
        q = adopt(cls, mod)
        q.init_quantizers(spec, name, activation)
        return q

    def to_float(self) -> nn.Module:
        """The float module again: same Parameters, quantizers and QAT attributes removed."""
        return release(self)

    def init_quantizers(self, spec, name: str = "", activation=None) -> None:
        """Build ``input_quant`` / ``weight_quant`` / ``output_quant`` from ``spec``'s tensor specs."""
        self.qat_name = name
        self.activation = activation
        self.bias_mode = "int32"
        in_spec, w_spec, out_spec = role_specs(spec)
        group = w_spec is not None and w_spec.granularity == "per_group"
        axis = self.weight_reduction_axis if group else self.weight_channel_axis
        if group and hasattr(self, "weight"):
            size = int(w_spec.group_size)
            ax = w_spec.axis if w_spec.axis is not None else axis
            if size <= 0 or self.weight.shape[ax] % size:
                # Groups that do not tile the reduction axis: per-channel is the closest valid choice.
                self.group_fallback = f"group size {size} does not divide {self.weight.shape[ax]}: per_channel used"
                w_spec = per_channel_variant(w_spec)
                axis = self.weight_channel_axis
        self.input_quant = make_quantizer(in_spec, None, f"{name}.input_quant")
        self.weight_quant = make_quantizer(w_spec, axis, f"{name}.weight_quant") if hasattr(self, "weight") else None
        self.output_quant = make_quantizer(out_spec, None, f"{name}.output_quant")

    def quantized_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the matrix engine sees it: masked (2:4), then fake-quantized."""
        mask = getattr(self, "weight_mask", None)
        if mask is not None:
            weight = weight * mask.to(weight.dtype)
        return self.weight_quant(weight) if self.weight_quant is not None else weight

    def bias_scale(self) -> Optional[torch.Tensor]:
        """float32(s_in) * float32(s_w) when both are active integer quantizers, else None."""
        if self.bias_mode != "int32" or not (_active_integer(self.input_quant) and _active_integer(self.weight_quant)):
            return None
        if self.weight_quant.granularity.block_size:
            return None  # per-group weights: no single scale per output channel; bias stays float
        s_in = self.input_quant.scale.detach().float().reshape(())
        return (s_in * self.weight_quant.scale.detach().float()).reshape(-1)

    def quantized_bias(self, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if bias is None:
            return None
        if self.bias_mode == "int32" and _active_integer(self.input_quant) and _active_integer(self.weight_quant) \
                and not self.weight_quant.granularity.block_size:
            # bias_scale's product and the int32 fake quantization in one C++ call (same bits), where it
            # applies; the scales are read, never differentiated (bias_scale detaches them)
            fast = bias_fake_quantize(bias, self.input_quant.scale, self.weight_quant.scale)
            if fast is not None:
                return fast
        scale = self.bias_scale()
        if scale is None:
            q_w = self.weight_quant
            if q_w is not None and not q_w.fmt.is_scaled and q_w.state in ("quantize", "frozen"):
                # an FP16 / BF16 layer: the exporter writes its bias in that format (SPEC.md §6)
                return fake_quantize(bias, q_w.fmt, check=False)
            return bias
        if scale.numel() == 1:
            scale = scale.reshape(())
            return fake_quantize(bias, INT32, scale, None, check=False)
        return fake_quantize(bias, INT32, scale, None, Granularity(axis=0), check=False)

    def quantizers(self) -> dict[str, FakeQuantizer]:
        """Role -> quantizer, for the roles this module quantizes."""
        return {k: q for k in ("input_quant", "weight_quant", "output_quant")
                if (q := getattr(self, k, None)) is not None}

    def finish(self, y: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``output_quant(activation(y))``; ``inplace`` as in :func:`apply_activation` (``y`` is the caller's own)."""
        y = apply_activation(y, self.activation, inplace)
        return self.output_quant(y) if self.output_quant is not None else y

    def qat_extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return f"bias_mode={self.bias_mode}{act}"


class QWeightedModule(QATModule):
    """Conv and Linear drop-ins: ``finish(op(fq_in(x), fq_w(W), fq_bias(b)))``, where the float
    op is the torch class's own (``_conv_forward``, ``F.linear``) given by ``weighted_op``."""

    def weighted_op(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x):
        if self.input_quant is not None:
            x = self.input_quant(x)
        return self.finish(self.weighted_op(x, self.quantized_weight(self.weight), self.quantized_bias(self.bias)))

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.qat_extra_repr()}"
