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


def slots_of(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """``id(module) -> [(parent, name), ...]``: every slot each module of ``root`` sits in.

    A module shared under several names (timm CoaT's ``cpe1`` is also
    ``serial_blocks1.0.cpe``) has one slot per name; ``named_modules`` would list it once."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        parent = stack.pop()
        if id(parent) in seen:
            continue
        seen.add(id(parent))
        for name, child in parent._modules.items():
            if child is not None:
                slots.setdefault(id(child), []).append((parent, name))
                stack.append(child)
    return slots


def replace_everywhere(slots: dict, old: nn.Module, new: nn.Module) -> int:
    """Put ``new`` in every slot ``old`` holds (``slots`` from :func:`slots_of`, updated);
    returns how many slots changed. A shared module stays shared: each of its names now
    holds the same ``new``."""
    places = slots.pop(id(old), [])
    for parent, name in places:
        parent._modules[name] = new
    slots.setdefault(id(new), []).extend(places)
    return len(places)
