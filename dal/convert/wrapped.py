"""The attributes a parent reads through a module dal.convert swapped in.

Each integer-model form (``IntegerLayer``, ``LayerNormForm``, ...) wraps the QAT or float module it
replaces. A parent's forward may read that module's attributes rather than call it: HF ViT reads
``projection.weight.dtype``, Whisper's encoder ``conv1.stride``, a TransformerEncoderLayer its
norm's ``eps``. Those reads go to the wrapped module, so the parent runs as it did in the QAT model.
"""
from __future__ import annotations

from torch import nn

from ..nn.adopt import QAT_ATTRS, QAT_SUBMODULES
from ..nn.tree import has_instance_attribute, instance_attributes, own_slots


def float_attribute(inner: nn.Module, name: str):
    """``(True, value)`` when ``name`` is one of ``inner``'s float-module attributes: a parameter
    or buffer, or an entry of its ``__dict__`` that nn.Module keeps for every module's own state
    (``stride``, ``eps``, ``in_features``, a library's ``hidden_state_size``) and that dal's QAT
    wrapping did not add (``adopt.QAT_ATTRS``, the quantizers); else ``(False, None)``."""
    if name in QAT_ATTRS or name in QAT_SUBMODULES or name.startswith("__"):
        return False, None
    slots = own_slots(inner)
    for table in (slots.parameters, slots.buffers):
        if name in table:
            return True, table[name]
    if not name.startswith("_") and has_instance_attribute(inner, name):
        return True, instance_attributes(inner)[name]
    return False, None


class WrapsModule(nn.Module):
    """A form that wraps one module (its submodule named by ``wrapped``): an attribute lookup
    nn.Module does not resolve falls back to that module's float attributes
    (:func:`float_attribute`); anything else is the usual AttributeError."""

    wrapped = "qat"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get(type(self).wrapped)
            found, value = float_attribute(inner, name) if inner is not None else (False, None)
            if not found:
                raise
            return value
