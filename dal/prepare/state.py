"""Model-wide switches: quantizer states, BN freezing, and undoing the swap."""
from __future__ import annotations

from torch import nn

from ..nn.base import QATModule
from ..nn.tree import set_submodule
from ..quantizer import FakeQuantizer, quantizers

__all__ = ["quantizers", "set_quantizer_state", "freeze_bn", "to_float"]


def set_quantizer_state(model: nn.Module, state: str) -> nn.Module:
    """Put every FakeQuantizer of ``model`` in ``state`` (observe / quantize / frozen / off).

    A quantizer that is observing ends its observation (``FakeQuantizer.end_observation``):
    it takes its scale from what its observer saw, then switches, so that observing a few
    batches by hand and then ``set_quantizer_state(model, "frozen")`` is a calibration. For a
    switch that restores states exactly, use ``dal.quantizer_states``."""
    for _, q in quantizers(model):
        q.end_observation(state)
    return model


def freeze_bn(model: nn.Module, frozen: bool = True) -> nn.Module:
    """Freeze (or unfreeze) BN statistics in every fused Conv+BN of ``model``."""
    for mod in model.modules():
        if hasattr(mod, "freeze_bn") and hasattr(mod, "bn_frozen"):
            mod.freeze_bn(frozen)
    return model


def to_float(model: nn.Module) -> nn.Module:
    """Undo the module swap in place: every QAT module becomes its float module again (same
    Parameter objects; fused Conv+BN become Sequential(conv, bn[, relu])). Functional-op
    quantizers (QAdd, ...) are turned off, since the rewritten forward still calls them."""
    for name, mod in list(model.named_modules()):
        if not name or not isinstance(mod, QATModule):
            continue
        if mod.swappable:
            set_submodule(model, name, mod.to_float())
        else:
            for q in mod.modules():
                if isinstance(q, FakeQuantizer):
                    q.set_state("off")
    return model
