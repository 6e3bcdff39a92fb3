"""A BatchNorm with its activation inside (timm's ``BatchNormAct2d``): its BN folds into the conv
before it, its activation stays.

timm builds EfficientNet, MobileNetV3, RegNet and more from ``BatchNormAct2d``: a BatchNorm2d
subclass whose forward is BatchNorm2d's (copied, including the running-statistics update)
followed by ``self.drop`` and ``self.act``. ``dal.prepare`` folds ``conv -> BatchNormAct2d``
like ``conv -> BatchNorm2d``: the QConvBn2d takes :func:`bare_batchnorm` (a plain BatchNorm2d
holding the same parameter and buffer tensors, nothing copied) and the module itself becomes
:class:`ActAfterFold`, which keeps ``drop`` and ``act`` under their paths (``bn1.act`` is still
``bn1.act``: the plan's steps for the activation apply as planned).

One that no conv absorbs (after a Concat, as DenseNet's pre-activation norms, or at the model's
input) becomes :class:`NormActAffine`: its BN part the same ``QBatchNorm2d`` a plain unfolded
BatchNorm2d becomes (dal.nn.norm: a per-channel affine, exported as a depthwise 1x1 Conv), at
``<path>.bn``, and ``drop`` and ``act`` again at their paths, so it exports and runs on the NPU.

Only this class, defined in ``timm.layers``, and only instances whose children are exactly
``drop`` and ``act``: a subclass, a look-alike from elsewhere, or any other BatchNorm2d subclass
with a forward of its own is never folded (``own_forward.folds_as_batchnorm``) but listed.
"""
from __future__ import annotations

import torch
from torch import nn

from .norm import QBatchNorm2d
from .tree import own_slots


def is_norm_act(m) -> bool:
    """timm's BatchNormAct2d as the module doc describes it."""
    cls = type(m)
    return (cls.__name__ == "BatchNormAct2d" and cls.__module__.startswith("timm.layers")
            and isinstance(m, nn.BatchNorm2d) and set(own_slots(m).modules) == {"drop", "act"})


def bare_batchnorm(m: nn.BatchNorm2d) -> nn.BatchNorm2d:
    """A plain BatchNorm2d with ``m``'s configuration and its own parameter / buffer tensors."""
    bn = nn.BatchNorm2d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, device="meta")
    for name, p in own_slots(m).parameters.items():
        setattr(bn, name, p)
    for name, b in own_slots(m).buffers.items():
        setattr(bn, name, b)
    return bn.train(m.training)


class ActAfterFold(nn.Module):
    """What remains of a norm-act module once its BN is folded: ``act(drop(x))``."""

    def __init__(self, norm_act: nn.Module):
        super().__init__()
        self.drop, self.act = norm_act.drop, norm_act.act
        self.train(norm_act.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(x))


class NormActAffine(nn.Module):
    """A norm-act module no conv absorbs: ``act(drop(bn(x)))``, ``bn`` the QBatchNorm2d of its BN
    part (the same Parameter and buffer objects), ``drop`` and ``act`` its own modules."""

    def __init__(self, bn: QBatchNorm2d, norm_act: nn.Module):
        super().__init__()
        self.bn, self.drop, self.act = bn, norm_act.drop, norm_act.act
        self.train(norm_act.training)

    @classmethod
    def from_norm_act(cls, norm_act: nn.Module, spec, name: str) -> "NormActAffine":
        """``norm_act`` (``is_norm_act``) with its BN as ``QBatchNorm2d`` per ``spec``, named ``<name>.bn``."""
        return cls(QBatchNorm2d.from_float(bare_batchnorm(norm_act), spec, f"{name}.bn"), norm_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self.bn(x)))
