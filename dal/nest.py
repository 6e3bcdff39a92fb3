"""A model's output as a nest of tensors: its tensor leaves, their names, and the nest rebuilt.

torchvision segmenters return a dict, Hugging Face models a ``ModelOutput`` (an ``OrderedDict``
subclass and a dataclass), detectors tuples or lists of dicts. Export, verify, convert and the
report all read the same flat list of tensors out of such a nest, in one order:

* a tensor is a leaf;
* a mapping (``dict``, ``OrderedDict``, ``ModelOutput``, ...) is walked in insertion order,
  each value named by its key;
* a dataclass instance is walked in field order (``dataclasses.fields``), each field by its name;
* a list or tuple (named tuples too) is walked by position, each item named by its index;
* anything else (``None``, ints, strings, ...) is a leaf that is no tensor: it holds a place
  in the nest but is not an output of the ONNX graph.

Depth-first: a container's whole content comes before its next sibling. A leaf's name is the
root name followed by ``.key`` per level: ``output`` for a lone tensor, ``output.0``,
``output.logits``, ``output.aux.0``. The ONNX file dal.export_onnx writes has one graph output
per tensor leaf, in this order and by these names.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

#: the root name of a model's output nest
ROOT = "output"


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _children(value) -> list[tuple[str, Any]] | None:
    """``[(key, child)]`` of a container, or None for a leaf (mapping first: a ``ModelOutput``
    is a mapping and a dataclass, and the two agree on order)."""
    if _is_tensor(value):
        return None
    if isinstance(value, Mapping):
        return [(str(k), v) for k, v in value.items()]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(value)]
    return None


def leaves(value, root: str = ROOT) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``value`` as ``(name, leaf)``, depth-first in the module's order (tensors,
    ``None`` and other non-containers alike).

    >>> list(leaves({"out": 1, "aux": [None, 2]}))
    [('output.out', 1), ('output.aux.0', None), ('output.aux.1', 2)]
    """
    kids = _children(value)
    if kids is None:
        yield root, value
        return
    for key, child in kids:
        yield from leaves(child, f"{root}.{key}")


def named_tensors(value, root: str = ROOT) -> list[tuple[str, Any]]:
    """``[(name, tensor)]``: the tensor leaves of ``value`` in order (the ONNX graph's outputs).

    A lone tensor is ``[("output", t)]``; ``{"out": a, "aux": b}`` is
    ``[("output.out", a), ("output.aux", b)]``."""
    return [(name, leaf) for name, leaf in leaves(value, root) if _is_tensor(leaf)]


def tensors(value) -> list:
    """The tensor leaves of ``value`` in order (``named_tensors`` without the names)."""
    return [t for _, t in named_tensors(value)]


def names(value, root: str = ROOT) -> list[str]:
    """The names of the tensor leaves of ``value`` in order."""
    return [n for n, _ in named_tensors(value, root)]


def map_tensors(fn: Callable, value):
    """``value`` with every tensor leaf ``t`` replaced by ``fn(t)``, the containers rebuilt as
    the same types (a dict subclass, a dataclass and a named tuple keep their type; the other
    leaves are kept as they are)."""
    it = iter([fn(t) for t in tensors(value)])
    return _rebuild(value, it)


def unflatten(value, new: Sequence):
    """``value`` (the nest) with its tensor leaves replaced, in order, by ``new``; the inverse of
    ``tensors``: ``unflatten(v, tensors(v))`` rebuilds ``v``. ``len(new)`` must equal the number
    of tensor leaves, else ValueError names both counts."""
    count = len(tensors(value))
    if len(new) != count:
        raise ValueError(f"unflatten: the nest holds {count} tensor(s), got {len(new)} to put in it")
    return _rebuild(value, iter(new))


def _rebuild(value, it: Iterator):
    if _is_tensor(value):
        return next(it)
    if isinstance(value, Mapping):
        out = copy.copy(value)  # keeps the type (OrderedDict, ModelOutput, ...) and its key order
        for k, v in value.items():
            out[k] = _rebuild(v, it)
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(out, f.name, _rebuild(getattr(value, f.name), it))  # frozen ones too
        return out
    if isinstance(value, tuple):
        items = [_rebuild(v, it) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(_rebuild(v, it) for v in value)
    return value
