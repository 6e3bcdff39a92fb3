"""QConvBn2d / QConvBnReLU2d: Conv2d + BatchNorm2d (+ ReLU) with BN folded for QAT.

Training (BN not frozen), as production QAT does it (Krishnamoorthi 2018; torch.ao):

    f     = gamma / sqrt(running_var + eps)                 per output channel, each op
                                                            correctly rounded (dal.formats.fold_factor)
    y     = conv(x, fq_w(W * f)) / f (+ conv bias)          quantized *folded* weights
    y     = BN(y)                                           batch statistics; running stats update

A convolution is linear in each output channel's weights, so ``conv(x, V) / f`` equals
``conv(x, V / f)`` in real arithmetic (in float32 the two differ by rounding only). Each
step takes the cheaper of the two (``_divide_output``): on the weight, the division is part of
the fold's one C++ pass (a division per weight, the folded weight read again in the backward);
on the output it is an autograd node of its own, with a forward and a backward pass over the
conv output and a fixed cost per call. ``BN`` stays
torch's module with its own running-statistics semantics (momentum, ``momentum=None``,
``num_batches_tracked``). The division of the output has a one-pass backward with the same
bits (``dal.nn.channel_divide``).

Where the weight quantizer fake-quantizes with the straight-through estimator on CPU float32,
``fq_w(W * f) [/ f]`` and its backward are one C++ pass each over the weight, the observer's
per-channel range included (``FakeQuantizer.fold_quantize``, ``dal.formats.fold``): the same
bits as the ops one by one, in about a quarter of their memory traffic.

Eval, or after ``freeze_bn()``: exactly the folded layer the hardware runs,

    y = conv(x, fq_w(W * f), fq_b(beta + (b - running_mean) * f))

which, with all quantizers off, equals the float Conv+BN within float rounding.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..formats.fold_factor import fold_factor
from .adopt import adopt, release
from .base import QATModule
from .channel_divide import channel_divide
from .own_forward import folds_as_batchnorm


class QConvBn2d(QATModule, nn.Conv2d):
    """Conv2d with a BatchNorm2d folded into its weight and bias; see the module docstring."""

    default_activation = None

    @classmethod
    def from_float(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, spec=None, name: str = "", activation="default"):
        if type(conv) is not nn.Conv2d or not folds_as_batchnorm(bn):
            raise TypeError(f"{cls.__name__} fuses nn.Conv2d + nn.BatchNorm2d (torch's forward), got "
                            f"{type(conv).__name__} + {type(bn).__name__} at {name or '<unnamed>'}")
        if bn.num_features != conv.out_channels:
            raise ValueError(f"{name}: BatchNorm2d has {bn.num_features} features but the conv has "
                             f"{conv.out_channels} output channels")
        if not bn.track_running_stats:
            raise ValueError(f"{name}: BatchNorm2d without running statistics cannot be folded")
        q = adopt(cls, conv)
        q.bn = bn
        q.init_quantizers(spec, name, cls.default_activation if activation == "default" else activation)
        q.register_buffer("bn_frozen", torch.tensor(False))
        return q

    def freeze_bn(self, frozen: bool = True) -> "QConvBn2d":
        """Stop updating BN statistics and train with the eval-mode folding from now on."""
        self.bn_frozen.fill_(bool(frozen))
        self.bn_frozen_flag = bool(frozen)
        return self

    def _bn_is_frozen(self) -> bool:
        """``bn_frozen``'s value. Under torch.compile its Python mirror ``bn_frozen_flag`` (kept by
        ``freeze_bn``, ``train`` and each eager forward): reading the buffer would break the graph."""
        flag = self.__dict__.get("bn_frozen_flag")
        if flag is not None and torch.compiler.is_compiling():
            return flag
        self.bn_frozen_flag = flag = bool(self.bn_frozen)
        return flag

    def _fold_factor(self) -> torch.Tensor:
        """``gamma / sqrt(running_var + eps)`` per output channel, each operation correctly rounded
        (``dal.formats.fold_factor``: float32 ``torch.sqrt`` is not on the CPU, so the exported
        weights would depend on the machine)."""
        bn = self.bn
        return fold_factor(bn.weight if bn.affine else None, bn.running_var, bn.eps)

    def _training_fold_factor(self) -> torch.Tensor:
        """``_fold_factor()`` with 1 where it is 0. A channel with gamma = 0 (timm's and
        torchvision's zero-init of a residual block's last BN) has f = 0, and training's
        ``fq_w(W * f) / f`` would be 0 / 0 = NaN in the forward and every gradient. Its BN output
        is beta whatever the conv computes, so the conv may take f = 1 there: ``fq_w(W) / 1``,
        finite, and gamma's gradient from BN is the float model's. Eval and export keep f = 0
        (the folded weight is 0 and the bias beta, which is exact). Other channels: the same bits."""
        bn = self.bn
        if torch.compiler.is_compiling():
            # One op whose result autograd saves (dal.kernels.fold_factor: BN updates running_var in this
            # forward, and AOTAutograd would recompute torch ops from the updated value in the backward).
            return kernels.fold_factor(bn.weight if bn.affine else None, bn.running_var, bn.eps, ones_for_zero=True)
        return fold_factor(bn.weight if bn.affine else None, bn.running_var, bn.eps, ones_for_zero=True)

    def unfold_weight(self, w: torch.Tensor) -> torch.Tensor:
        """The ``weight`` whose folded form (``folded_weight_and_bias()[0]``, ``weight * f``) is
        ``w``: ``w / f`` per output channel, with the eval fold factor ``f`` detached (so
        differentiable in ``w`` only). A channel with ``f = 0`` gives inf or NaN."""
        return w / self._fold_factor().detach().reshape(-1, *([1] * (w.dim() - 1)))

    def folded_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W * f, beta + (b - mean) * f) in float: what the exporter and hardware see before quantization."""
        f = self._fold_factor()
        return self.weight * f.reshape(-1, 1, 1, 1), self._folded_bias(f)

    def _folded_bias(self, f: torch.Tensor) -> torch.Tensor:
        b = self.bias if self.bias is not None else torch.zeros_like(f)
        beta = self.bn.bias if self.bn.affine else torch.zeros_like(f)
        return beta + (b - self.bn.running_mean) * f

    def _divide_output(self, x: torch.Tensor) -> bool:
        """Whether the 1/f of training goes on the conv output rather than the weight (module doc):
        only where the weight holds more than ``32 * out + 2**19`` values, ``out`` the output's.

        Measured per layer (forward + backward on the layer's real input, both routes): the
        weight won on every layer of SSDlite320 at batch 2 and 8 (the largest weight 131 K values)
        and of FCOS-ResNet50 at batch 8; the output won only on FCOS's largest weights at batch 2
        (2.4 M weights against 26 K outputs, by ~1%). Without the C++ fold (``_folded_weight``'s
        torch fallback, no compiler) the weight's division is a torch op of its own; the rule was
        not measured there. The output's size is estimated as
        ``N * C_out * H * W / (stride_h * stride_w)`` (padding ignored): the choice only moves
        float rounding, never the formula.
        """
        out = x.numel() // x.shape[-3] * self.out_channels // (self.stride[0] * self.stride[1])
        return self.weight.numel() > 32 * out + (1 << 19)

    def forward(self, x):
        if self.input_quant is not None:
            x = self.input_quant(x)
        if self.training and not self._bn_is_frozen():
            # The weight quantizer must see the folded weight W * f (the grid the hardware uses);
            # the 1/f that undoes the folding goes where it costs less (module doc).
            if self._divide_output(x):
                f = self._training_fold_factor()
                y = channel_divide(self._conv_forward(x, self._folded_weight(f, False), None), f)
                if self.bias is not None:
                    y = y + self.bias.reshape(1, -1, 1, 1)
            else:
                y = self._conv_forward(x, self._folded_weight(self._training_fold_factor(), True), self.bias)
            y = self.bn(y)
        else:
            f = self._fold_factor()
            y = self._conv_forward(x, self._folded_weight(f, False), self.quantized_bias(self._folded_bias(f)))
        # y is this forward's own BN / conv / division output, which no autograd node saved: in training
        # the fused ReLU overwrites it (as torchvision's ReLU(inplace=True) after a BN), the same bits
        # forward and backward without a fresh tensor; eval (export, convert's probes) keeps F.relu.
        return self.finish(y, inplace=self.training)

    def _folded_weight(self, f: torch.Tensor, divide: bool) -> torch.Tensor:
        """``fq_w(W * f)``, divided by ``f`` again when ``divide``: one C++ pass over the weight
        where ``FakeQuantizer.fold_quantize`` applies (the same bits), else op by op."""
        if self.weight_quant is not None and getattr(self, "weight_mask", None) is None:
            w = self.weight_quant.fold_quantize(self.weight, f, divide)
            if w is not None:
                return w
        f = f.reshape(-1, 1, 1, 1)
        w = self.quantized_weight(self.weight * f)
        return w / f if divide else w

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and "bn_frozen" in self._buffers and self._bn_is_frozen():
            self.bn.eval()  # frozen BN keeps its running statistics
        return self

    def to_float(self) -> nn.Module:
        """nn.Sequential(conv, bn[, ReLU]) computing the same float function."""
        bn = self.bn
        conv = release(self, nn.Conv2d)
        layers = [conv, bn] + ([nn.ReLU()] if self.activation == "relu" else [])
        return nn.Sequential(*layers)

    def extra_repr(self):
        return f"{super().extra_repr()}, {self.qat_extra_repr()}"


class QConvBnReLU2d(QConvBn2d):
    """QConvBn2d followed by a fused ReLU (applied before the output quantizer)."""

    default_activation = "relu"
