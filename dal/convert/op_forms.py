"""dal.convert's reading of the op registry (:mod:`dal.ops`): the callables through which a
``TorchFunctionMode`` sees an op's calls, the integer forms of those calls, and the tables the
probe (probe.py) derives from the registry.

A ``TorchFunctionMode`` receives torch functions as they are (``torch.sigmoid``, ``F.relu``) and
a Tensor method as the ``torch.Tensor`` attribute (``torch.Tensor.sigmoid``; ``x + y`` as
``torch.Tensor.__add__``), while the registry keys methods by name: :func:`calls_of` turns an
op's patterns into the callables the mode receives. Python's ``operator`` functions never reach
a mode (``a + b`` arrives as ``torch.Tensor.__add__``), so they are left out.

An op's ``integer_form`` is a ``"dal.convert.<module>:<name>"`` reference to either

- a form: a function with the torch function's arguments returning what the exported nodes
  compute, or None to let torch's own op run (float_ops.py ``sigmoid_f64``); or
- a form factory (:func:`form_factory`): ``factory(func, opset) -> form | None``, for a form
  that depends on which of the op's callables was called (``avg_pool``: AveragePool for
  ``F.avg_pool2d``, GlobalAveragePool for an adaptive pool to 1) or, ``needs_opset``, on the
  export's opset (GELU, LayerNorm and SDPA are spelled by it).

The tables are made on first use, never at import, and again when the registry has changed (a
user's ``dal.ops.register`` / ``unregister``). The patterns dal.ops does not hold yet are read
from pending_ops.py as if it did.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from typing import Callable, Optional

import torch

from .. import ops as registry
from .pending_ops import pending_ops


def _reaches_mode(func) -> bool:
    """False for Python's ``operator`` functions: ``a + b`` reaches a mode as ``Tensor.__add__``."""
    return getattr(func, "__module__", None) != operator.add.__module__


def calls_of(op) -> tuple:
    """The callables through which a TorchFunctionMode receives a call of ``op``: its
    ``functions`` that reach a mode (module doc), then ``torch.Tensor.<name>`` for each of its
    ``methods``, in that order: for ``add`` ``(torch.add, torch.Tensor.add, torch.Tensor.add_,
    torch.Tensor.__add__, ...)``, not ``operator.add``."""
    methods = (getattr(torch.Tensor, m, None) for m in op.methods)
    return tuple(f for f in op.functions if _reaches_mode(f)) + tuple(f for f in methods if f is not None)


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    return name if isinstance(name, str) else ""


def in_place(func) -> bool:
    """torch's in-place spelling: a name ending in one underscore (``relu_``, ``clamp_``) or an
    augmented assignment (``__iadd__``: ``__add__`` with an ``i``)."""
    name = _name(func)
    if name.startswith("__i") and name.endswith("__"):
        return hasattr(torch.Tensor, "__" + name[3:])
    return name.endswith("_") and not name.endswith("__")


def reflected(func) -> bool:
    """A reflected operator method (``__radd__``, ``__rsub__``: ``n + x``, ``n - x``)."""
    name = _name(func)
    return name.startswith("__r") and name.endswith("__") and hasattr(torch.Tensor, "__" + name[3:])


def in_place_variant(func):
    """``f_`` for a torch function, ``F`` function or Tensor method ``f`` that has one
    (``torch.clamp`` -> ``torch.clamp_``, ``F.hardtanh`` -> ``F.hardtanh_``); else None."""
    name = _name(func)
    if not name or in_place(func):
        return None
    for space in (torch, torch.nn.functional, torch.Tensor):
        if getattr(space, name, None) is func:
            return getattr(space, name + "_", None)
    return None


def form_factory(needs_opset: bool) -> Callable:
    """Mark ``factory(func, opset) -> form | None`` as an integer form that depends on the call
    (module doc): ``func`` is the callable the mode received (one of :func:`calls_of`), ``opset``
    the export's. ``needs_opset``: the form exists only where the export's opset is known
    (:func:`opset_forms`); otherwise the factory is asked with ``opset=None`` (:func:`float_forms`)."""
    def mark(factory):
        factory.needs_opset = bool(needs_opset)
        return factory
    return mark


def is_form_factory(form) -> bool:
    """Whether ``form`` (an op's resolved ``integer_form``) was marked by :func:`form_factory`."""
    return isinstance(getattr(form, "needs_opset", None), bool)


class _Ops(tuple):
    """The ops at one moment of the registry: a cache key, hashed (once) and compared by identity."""

    def __new__(cls, ops):
        self = super().__new__(cls, ops)
        self.key = hash(tuple(map(id, self)))
        return self

    def __hash__(self):
        return self.key

    def __eq__(self, other):
        return len(self) == len(other) and all(a is b for a, b in zip(self, other))


#: [(the registry's ops, their merged _Ops)]: the last state seen (the registry seldom changes)
_LAST: list = []


def _ops() -> _Ops:
    """The registry's ops with pending_ops.py's patterns that no registered op matches merged in
    (by name: an alias adds its patterns to the op of its name; another is an op of its own)."""
    ops = registry.all_ops()
    if not _LAST or _LAST[0][0] != ops:  # a tuple compare: each element by identity first
        _LAST[:] = [(ops, _merged(ops))]
    return _LAST[0][1]


def _merged(ops: tuple) -> _Ops:
    by_name = {op.name: op for op in ops}
    for p in pending_ops():
        functions = tuple(f for f in p.functions if registry.by_function(f) is None)
        methods = tuple(m for m in p.methods if registry.by_method(m) is None)
        op = by_name.get(p.name)
        if op is None:
            by_name[p.name] = dataclasses.replace(p, functions=functions, methods=methods)
        elif functions or methods:
            by_name[p.name] = dataclasses.replace(op, functions=op.functions + functions, methods=op.methods + methods)
    return _Ops(by_name.values())


def float_forms() -> dict:
    """``{callable: form}``: every out-of-place call (:func:`calls_of`) of an op with an
    ``integer_form`` to its form: the form itself, or a factory's form for that callable
    (``needs_opset`` False, asked with ``opset=None``; a None form is left out). In-place calls
    keep torch's op: a form returns a new tensor."""
    return _forms(_ops(), None, False)


def opset_forms(opset: int) -> dict:
    """``{callable: form}`` of the ``needs_opset`` factories (GELU, softmax, LayerNorm, SDPA) made
    for ``opset``, as :func:`float_forms` for the others."""
    return _forms(_ops(), int(opset), True)


@functools.lru_cache(maxsize=16)
def _forms(ops: _Ops, opset: Optional[int], needs_opset: bool) -> dict:
    forms = {}
    for op in ops:
        if op.integer_form is None:
            continue
        form = op.resolve("integer_form")
        factory = is_form_factory(form)
        if (factory and form.needs_opset) != needs_opset:
            continue
        for f in calls_of(op):
            made = form(f, opset) if factory else form
            if made is not None and not in_place(f):
                forms[f] = made
    return forms


def per_registry(build: Callable) -> Callable:
    """``build(ops)`` (``ops``: every registered op) as a function of no arguments whose result is
    kept until the registry changes: a table derived on first use, not at import."""
    kept = functools.lru_cache(maxsize=4)(build)

    @functools.wraps(build)
    def table():
        return kept(_ops())
    return table


class Derived(Mapping):
    """A read-only table computed by ``build()`` from the registry whenever it is read (``build``
    caches by the registry's state), so that a module can hold it as a constant without deriving
    it at import: ``f in table``, ``table[f]``, iteration, ``len``. ``build`` returns a dict, or a
    set (then ``table[f]`` is True for its members)."""

    def __init__(self, build: Callable[[], object]):
        self._build = build

    def __getitem__(self, key):
        table = self._build()
        if isinstance(table, Mapping):
            return table[key]
        if key in table:
            return True
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return key in self._build()

    def __iter__(self):
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())
