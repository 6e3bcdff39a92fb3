"""Where a module sits in a model: the one way dal puts a module in its parent's place."""
from __future__ import annotations

from torch import nn


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    """Make ``new`` the module at dotted ``path`` of ``root`` (its parent's slot, same name).

    Writes the parent's ``_modules`` entry directly rather than ``setattr``: a GraphModule or a
    user class with a custom ``__setattr__`` still keeps its attribute name, and the slot's
    order among siblings (``named_modules`` order, the report's order) is unchanged."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    if leaf not in parent._modules:
        raise AttributeError(f"{type(parent).__name__} at {parent_path or '<root>'!r} has no submodule {leaf!r}")
    parent._modules[leaf] = new
