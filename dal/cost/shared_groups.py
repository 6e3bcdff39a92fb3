"""Searched layers the hardware makes share one activation format: those feeding one op it runs
without requantizing (``shared_scale: [cat, ...]`` in the hardware model, see
``dal.prepare.shared_scale``).

Mechanism: one forward of the base prepared model recorded by :mod:`dal.capture` (no grad, the
arguments kept; opaque: every quantizer, and every searched layer with no searched, requantizing
or shared-scale module inside it). Its value keys are the data flow: every functional QAT op whose
``op_class`` the hardware lists in ``shared_scale`` reads the values of its positional tensor
arguments; from each, the record is walked back, value by value, through the call that wrote it
(a function call, an opaque module call, or a module returning a tensor no recorded call wrote)
to that call's inputs. The walk stops

* at a searched layer's output: a member (a value that nested modules return is the output of
  the innermost of them);
* at the output of any other module with an output quantizer that is not itself a shared-scale
  op: it requantizes, so the format there is its own, not the searched layer's;
* where no gradient could flow: a value of neither floating nor complex dtype (indices, masks),
  the result of ``detach`` / ``.data`` / a ``*_like`` or ``new_*`` factory, and the tensor that
  only gives ``expand_as`` / ``view_as`` / ``reshape_as`` / ``type_as`` / ``to`` a shape or dtype.

An indexed assignment (``y[i] = x``) is a call writing a new version of ``y`` from ``y`` and
``x`` (dal.capture), so a value written that way is followed to ``x``.
"""
from __future__ import annotations

import torch

#: calls whose result carries no gradient (and so no format from the values they read)
_NO_FLOW = frozenset({"detach", "detach_", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                      "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full",
                      "new_tensor"})
#: calls whose data is their first tensor only (any other gives a shape, dtype or device)
_FIRST_ONLY = frozenset({"expand_as", "view_as", "reshape_as", "type_as", "to"})


def _name(call) -> str:
    """A function call's name (``"data"`` for the ``Tensor.data`` getter)."""
    fn = call.target
    name = getattr(fn, "__name__", "") or ""
    return getattr(getattr(fn, "__self__", None), "__name__", name) if name == "__get__" else name


def _flows(meta) -> bool:
    return meta.dtype.is_floating_point or meta.dtype.is_complex


def _sources(call) -> tuple:
    """The value keys whose data ``call`` (the writer of a value) carries on."""
    if call.kind == "function":
        name = _name(call)
        if name in _NO_FLOW or name == "data":
            return ()
        if name in _FIRST_ONLY:
            return call.ins[:1]
    return call.ins


def _positional(call) -> int:
    """How many of a module call's input keys (its arguments' tensors, positional ones first, walked
    through tuples, lists and dicts as the recorder walks them) come from its positional arguments."""

    def count(a) -> int:
        if isinstance(a, torch.Tensor):
            return 1
        if isinstance(a, (list, tuple)):
            return sum(count(x) for x in a)
        if isinstance(a, dict):
            return sum(count(x) for x in a.values())
        return 0

    return count(call.args)


def shared_scale_groups(prepared_model, example_inputs, names, op_classes) -> list:
    """Lists of searched layer paths (``names``) whose outputs feed one op of ``op_classes``
    in ``prepared_model``, one list (sorted) per such op call that more than one of them feeds, in
    the order the calls ran; each list must take one activation format. Empty when the hardware
    has no ``shared_scale`` op classes. Makes one forward of ``prepared_model`` (module docstring)."""
    from ..capture import capture
    from ..quantizer import FakeQuantizer

    wanted = set(op_classes or ())
    if not wanted:
        return []
    names = set(names)
    paths = {}
    for path, mod in prepared_model.named_modules():
        paths.setdefault(id(mod), path)

    def shared(mod) -> bool:
        return getattr(mod, "op_class", None) in wanted

    def barrier(mod) -> bool:
        return getattr(mod, "output_quant", None) is not None and not shared(mod)

    def marks(mod) -> bool:  # a searched layer or a requantizing module
        return paths.get(id(mod)) in names or barrier(mod)

    def opaque(mod) -> bool:
        if isinstance(mod, FakeQuantizer):
            return True
        return paths.get(id(mod)) in names and not any(marks(m) or shared(m) for m in mod.modules() if m is not mod)

    with torch.no_grad():
        record = capture(prepared_model, *example_inputs, opaque=opaque, sites=False, keep_args=True)
    stops: dict = {}    # value key -> searched layer path, or None for a requantizing barrier
    writer: dict = {}   # value key -> the call whose inputs it came from
    meta: dict = {}     # value key -> TensorMeta
    seen: set = set()
    feeds: list = []    # per shared-scale op call: the keys of its positional tensor arguments
    for c in record.calls:
        for k, m in zip(c.ins, c.in_meta):
            meta.setdefault(k, m)
        for k, m in zip(c.outs, c.out_meta):
            meta.setdefault(k, m)
        if c.kind == "function" or c.opaque:
            writer.update((k, c) for k in c.outs)
        else:  # a module returning a value no call inside it wrote (a C++ extension's) made it
            writer.update((k, c) for k in c.outs if k not in writer and k not in seen and k not in c.ins)
        seen.update(c.ins)
        seen.update(c.outs)
        if c.kind != "module":
            continue
        path = paths.get(id(c.target))
        if path in names:
            for k in c.outs:
                stops.setdefault(k, path)  # completion order: the innermost module first
        elif barrier(c.target):
            for k in c.outs:
                stops.setdefault(k, None)
        if shared(c.target):
            feeds.append(c.ins[:_positional(c)])
    groups = []
    for keys in feeds:
        members = set()
        for k in keys:
            members |= _producers(k, stops, writer, meta)
        if len(members) > 1:
            groups.append(sorted(members))
    return groups


def _producers(key, stops: dict, writer: dict, meta: dict) -> set:
    """Paths of the searched layers whose output reaches value ``key`` (iterative walk)."""
    found, stack, seen = set(), [key], set()
    while stack:
        k = stack.pop()
        if k in seen or not _flows(meta[k]):
            continue
        seen.add(k)
        if k in stops:
            if stops[k] is not None:
                found.add(stops[k])
            continue
        c = writer.get(k)
        if c is not None:
            stack.extend(_sources(c))
    return found
