"""Where a module sits in a model and what it holds itself: the one way dal puts a module in its
parent's place, and the one place dal reads or writes nn.Module's own tables (submodule, parameter
and buffer slots) and a module's instance attributes directly (tests/test_private_access.py)."""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

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


class Slots(NamedTuple):
    """A module's own registered names, each table a copy: name -> value, ``None`` slots
    included (``named_children`` / ``named_parameters`` / ``named_buffers`` skip those)."""
    modules: dict
    parameters: dict
    buffers: dict


def own_slots(module: nn.Module) -> Slots:
    """The submodule, parameter and buffer slots ``module`` itself registers (not its
    children's), in registration order; changing the copies changes nothing in ``module``."""
    return Slots(dict(module._modules), dict(module._parameters), dict(module._buffers))


def set_child(parent: nn.Module, name: str, new: Optional[nn.Module]) -> None:
    """Make ``new`` (a module or None) ``parent``'s submodule slot ``name``, adding the slot
    when absent; like :func:`set_submodule`, not through ``parent.__setattr__`` and keeping an
    existing slot's place among its siblings."""
    parent._modules[name] = new


def remove_child(parent: nn.Module, name: str) -> None:
    """Remove ``parent``'s submodule slot ``name`` if it has one (nothing else of ``parent`` changes)."""
    parent._modules.pop(name, None)


def shallow_copy(module: nn.Module, cls: Optional[type] = None) -> nn.Module:
    """A new instance of ``cls`` (default ``type(module)``; ``__init__`` is not run) holding
    ``module``'s attribute values: the same Parameter, buffer, submodule and config objects, in
    tables of its own (the submodule, parameter, buffer and hook dicts and sets are copies), so
    adding, replacing or removing a child or hook of the copy leaves ``module`` as it was."""
    cls = type(module) if cls is None else cls
    new = cls.__new__(cls)
    new.__dict__.update({k: copy.copy(v) if k.startswith("_") and isinstance(v, (dict, set)) else v
                         for k, v in module.__dict__.items()})
    return new


def has_instance_attribute(obj: object, name: str) -> bool:
    """Whether ``obj`` holds ``name`` as a plain attribute of its own: set on the instance (a
    ``self.x = None`` that nn.Module keeps outside its tables, a method shadowed on the
    instance), not a class attribute, property, parameter, buffer or submodule."""
    return name in obj.__dict__


def instance_attributes(obj: object) -> dict:
    """A copy of the attributes ``obj`` holds itself (what ``vars(obj)`` lists: for a module,
    its plain attributes and nn.Module's tables), name -> value."""
    return dict(vars(obj))
