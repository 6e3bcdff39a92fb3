"""What one captured forward holds: the calls it made, in completion order, and the values they
read and wrote (:mod:`dal.capture.recorder` fills it).

A *value* is one version of one tensor: a key (an int, counted from 1) given when a tensor is
first read, and a new key whenever a call writes it (an in-place ``relu_`` writes a new version
of its input; an opaque module's output is a new value even when it is its input object). Two
calls are connected when one reads a key the other wrote: that is the data flow every reader of
a record (prepare, convert's integer groups, the cost model) walks.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch


class TensorMeta(NamedTuple):
    """The shape (a ``torch.Size``) and dtype of one tensor a call read or wrote."""

    shape: tuple
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


def meta_of(tensors) -> tuple:
    """``TensorMeta`` of each tensor, in order."""
    return tuple([TensorMeta(t.shape, t.dtype) for t in tensors])


@dataclass(slots=True)
class Call:
    """One recorded call.

    ``kind``: ``"module"`` (a module's forward; ``target`` the module) or ``"function"`` (a torch
    function or Tensor method dispatched to the recorder; ``target`` the callable).
    ``path``: a module's own path, or, for a function, the path of the innermost module whose
    forward made the call (``""``: the root's). ``site``: a function's calling line
    (``file.py:line``, the first frame outside torch), ``""`` for a module.
    ``ins`` / ``outs``: the value keys read and written (module docstring); ``in_meta`` /
    ``out_meta``: their shapes and dtypes. ``depth``: how many module forwards enclose the call;
    ``opaque``: whether it is the call of an opaque module (its inside is not recorded).
    ``args`` / ``kwargs``: the call's arguments, kept only when the capture was asked to
    (``keep_args``)."""

    kind: str
    target: Any
    path: str
    ins: tuple
    outs: tuple
    in_meta: tuple
    out_meta: tuple
    depth: int
    site: str = ""
    opaque: bool = False
    args: tuple = ()
    kwargs: Optional[dict] = None

    @property
    def op(self):
        """The :mod:`dal.ops` op this call belongs to (by module type, or by the callable /
        Tensor method name), or None."""
        from ..ops import by_function, by_method, by_module

        if self.kind == "module":
            return by_module(type(self.target))
        return by_function(self.target) or by_method(getattr(self.target, "__name__", "") or "")


@dataclass(frozen=True, slots=True)
class Entry:
    """A :class:`Call` as plain data (it pickles and deep-copies with a model): ``kind``,
    ``name`` (the module's type name, or the function's / method's name), ``op`` (its
    :mod:`dal.ops` op's name, or None), ``path``, ``site``, ``in_meta``, ``out_meta``, ``depth``."""

    kind: str
    name: str
    op: Optional[str]
    path: str
    site: str
    in_meta: tuple
    out_meta: tuple
    depth: int


@dataclass
class Record:
    """One forward's calls (``calls``, in completion order: a module's call after the calls made
    inside it), ``outputs`` (the value keys of the root's tensor outputs, in ``dal.nest`` order),
    ``returned`` (what the root's forward returned, as it returned it: held as long as the
    record), ``called`` (ids of the modules whose forward ran, opaque or not,
    inside an opaque one included) and ``ran`` (the root's forward returned)."""

    calls: list = field(default_factory=list)
    outputs: tuple = ()
    returned: Any = None
    called: set = field(default_factory=set)
    ran: bool = False
    _keys: dict = field(default_factory=dict, repr=False)       # id(tensor) -> (weakref, key)
    _returned: dict = field(default_factory=dict, repr=False)   # id(tensor) -> (weakref, [who])
    _count: int = 0

    # -- values ----------------------------------------------------------------------------
    def key_of(self, t: torch.Tensor) -> Optional[int]:
        """The key of ``t``'s current value, or None when the record never saw it."""
        entry = self._keys.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def read(self, tensors) -> tuple:
        """The keys of ``tensors``' current values (a tensor never seen gets a new key)."""
        return tuple(k if (k := self.key_of(t)) is not None else self.write((t,))[0] for t in tensors)

    def write(self, tensors) -> tuple:
        """New keys for ``tensors`` (new values)."""
        keys = []
        for t in tensors:
            self._count += 1
            self._keys[id(t)] = (_ref(t), self._count)
            keys.append(self._count)
        return tuple(keys)

    # -- who returned what -----------------------------------------------------------------
    def note(self, t, who) -> None:
        """``who`` (a module id, ``(module id, i)`` for element ``i`` of a returned list / tuple,
        or a caller's own key) returned tensor ``t``, the same object (innermost first)."""
        if not torch.is_tensor(t):
            return
        entry = self._returned.get(id(t))
        if entry is None or entry[0]() is not t:
            entry = self._returned[id(t)] = (_ref(t), [])
        entry[1].append(who)

    def returned_by(self, t: torch.Tensor) -> list:
        """Who returned ``t`` (the same object; :meth:`note`), innermost first."""
        entry = self._returned.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else []

    def take(self, other: "Record") -> None:
        """Hold ``other``'s content instead of this record's own (a recording is moved in, or,
        with a new ``Record()``, this one is emptied)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(other, name))

    # -- views -----------------------------------------------------------------------------
    def functions(self) -> list:
        """The function calls, in order."""
        return [c for c in self.calls if c.kind == "function"]

    def modules(self) -> list:
        """The module calls, in order."""
        return [c for c in self.calls if c.kind == "module"]

    def entries(self) -> tuple:
        """Every call as an :class:`Entry`, in order."""
        found = []
        for c in self.calls:
            op = c.op
            name = type(c.target).__name__ if c.kind == "module" else getattr(c.target, "__name__", "") or repr(c.target)
            found.append(Entry(c.kind, name, op.name if op is not None else None, c.path, c.site, c.in_meta,
                               c.out_meta, c.depth))
        return tuple(found)

    def readers(self) -> dict:
        """{value key: [the calls that read it, in order]}."""
        found: dict = {}
        for c in self.calls:
            for k in c.ins:
                found.setdefault(k, []).append(c)
        return found


def _ref(t: torch.Tensor):
    """A weak reference to ``t`` (an id is only trusted while the object it named lives)."""
    try:
        return weakref.ref(t)
    except TypeError:  # a tensor subclass without weak references: keep it alive instead
        return (lambda: t)
