"""Model-wide switches: quantizer states, BN freezing, and undoing the swap."""
from __future__ import annotations

from typing import Iterator

from torch import nn

from ..quantizer import FakeQuantizer


def quantizers(model: nn.Module) -> Iterator[tuple[str, FakeQuantizer]]:
    for name, mod in model.named_modules():
        if isinstance(mod, FakeQuantizer):
            yield name, mod


def set_quantizer_state(model: nn.Module, state: str) -> nn.Module:
    """Put every FakeQuantizer of ``model`` in ``state`` (observe / quantize / frozen / off)."""
    for _, q in quantizers(model):
        q.set_state(state)
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
        if not name or not hasattr(mod, "qat_name"):
            continue
        parent_path, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if hasattr(mod, "to_float"):
            parent._modules[leaf] = mod.to_float()
        else:
            for q in mod.modules():
                if isinstance(q, FakeQuantizer):
                    q.set_state("off")
    return model
