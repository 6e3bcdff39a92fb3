"""QConvFrozenBn2d / QConvFrozenBnReLU2d: a Conv2d with a frozen BatchNorm folded into it.

A frozen BatchNorm (``dal.nn.frozen_bn``: torchvision's / timm's / Hugging Face's
``FrozenBatchNorm2d``, recognised by what it computes) folds into the conv before it as an
eval-mode BatchNorm2d with frozen statistics does in :class:`~dal.nn.conv_bn.QConvBn2d`, in
training and in eval alike (it has no statistics to update and no parameters to train):

    f = weight / sqrt(running_var + eps)           per output channel (dal.formats.fold_factor)
    y = conv(x, fq_w(W * f), fq_b(bias + (b - running_mean) * f))

``W`` and ``b`` are the conv's (``b`` = 0 without one) and train; the frozen BN's buffers stay
as they are: ``freeze_bn(False)`` (``dal.freeze_bn``, ``dal.ptq.reestimate_bn``) leaves it frozen.
The frozen module itself is kept at ``<conv>.bn`` (its buffers in the state dict under that
prefix); ``to_float`` gives back ``Sequential(conv, frozen_bn[, ReLU])``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats.fold_factor import fold_factor
from .adopt import adopt, release
from .conv_bn import QConvBn2d
from .frozen_bn import frozen_batchnorm_eps


class QConvFrozenBn2d(QConvBn2d):
    """Conv2d with a frozen BatchNorm folded into its weight and bias; see the module docstring."""

    default_activation = None

    @classmethod
    def from_float(cls, conv: nn.Conv2d, bn: nn.Module, spec=None, name: str = "", activation="default"):
        """The fold of ``conv`` and ``bn`` (a module :func:`~dal.nn.frozen_bn.frozen_batchnorm_eps`
        recognises); raises TypeError naming ``name`` otherwise, ValueError on a channel mismatch."""
        eps = frozen_batchnorm_eps(bn)
        if type(conv) is not nn.Conv2d or eps is None:
            raise TypeError(f"{cls.__name__} fuses nn.Conv2d + a frozen BatchNorm (dal.nn.frozen_bn: buffers weight, "
                            f"bias, running_mean, running_var and a forward computing the frozen-BN affine), got "
                            f"{type(conv).__name__} + {type(bn).__name__} at {name or '<unnamed>'}")
        if bn.running_var.numel() != conv.out_channels:
            raise ValueError(f"{name}: {type(bn).__name__} has {bn.running_var.numel()} channels but the conv has "
                             f"{conv.out_channels} output channels")
        q = adopt(cls, conv)
        q.bn = bn
        q.frozen_bn_eps = eps
        q.init_quantizers(spec, name, cls.default_activation if activation == "default" else activation)
        q.register_buffer("bn_frozen", torch.tensor(True))
        q.bn_frozen_flag = True
        return q

    def freeze_bn(self, frozen: bool = True) -> "QConvFrozenBn2d":
        """A frozen BatchNorm stays frozen whatever ``frozen`` says (no statistics to update)."""
        return self

    def _bn_is_frozen(self) -> bool:
        return True

    def _fold_factor(self) -> torch.Tensor:
        """``weight / sqrt(running_var + eps)`` of the frozen BN, each operation correctly rounded."""
        return fold_factor(self.bn.weight, self.bn.running_var, self.frozen_bn_eps)

    def _training_fold_factor(self) -> torch.Tensor:
        return fold_factor(self.bn.weight, self.bn.running_var, self.frozen_bn_eps, ones_for_zero=True)

    def _folded_bias(self, f: torch.Tensor) -> torch.Tensor:
        b = self.bias if self.bias is not None else torch.zeros_like(f)
        return self.bn.bias + (b - self.bn.running_mean) * f

    def to_float(self) -> nn.Module:
        """nn.Sequential(conv, frozen_bn[, ReLU]) computing the same float function."""
        bn = self.bn
        conv = release(self, nn.Conv2d, drop=("frozen_bn_eps",))
        layers = [conv, bn] + ([nn.ReLU()] if self.activation == "relu" else [])
        return nn.Sequential(*layers)


class QConvFrozenBnReLU2d(QConvFrozenBn2d):
    """QConvFrozenBn2d followed by a fused ReLU (applied before the output quantizer)."""

    default_activation = "relu"
