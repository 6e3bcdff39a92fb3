"""What one torch call is, for call-site capture (``call_sites``): a quantizable tensor-tensor op
(add, mul, cat, matmul, grid_sample, scatter-add, gather), a listed float op (``FloatOp``), or
nothing prepare lists (shapes, scalar and integer arithmetic, dtype queries).

:func:`classify_call` decides from the function's name and its arguments only; the names a
routed call can have are :func:`kind_names`, so the capture mode lets every other call pass
before reading a frame.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..nn.gather import gather_call_args
from ..nn.scatter_add import scatter_call
from ..ops import Op, get, select, version
from .float_ops import FloatOp, classify_node
from .functional_ops import call_form, functional_ops


def call_names() -> dict[str, Op]:
    """The functional op (``dal.ops``, handling ``functional``) of each name a call-site capture
    sees: ``func.__name__`` of a Tensor method (``"__radd__"``, ``"add_"``, ``"bmm"``) or of a torch
    function (``torch.concatenate``: ``"concatenate"``). A Python operator (``operator.add``) never
    reaches the capture (``a + b`` arrives as ``Tensor.__add__``), so its name is not one."""
    return _call_names(version())


@functools.cache
def _call_names(_version: int) -> dict[str, Op]:
    return {name: op for op in functional_ops() for name in _names_of(op)}


def _names_of(op: Op) -> tuple[str, ...]:
    """The names calls of ``op`` have in a call-site capture (:func:`call_names`)."""
    torch_functions = [fn for fn in op.functions if getattr(fn, "__module__", None) not in ("_operator", "operator")]
    return tuple(fn.__name__ for fn in torch_functions) + op.methods


def island_functions() -> frozenset:
    """The float functions routed to an FP16 island (``fp16_island.Fp16Function``) where the
    hardware check made their site one: the ops of op class ``softmax`` (an attention's weights,
    Deformable-DETR's MSDA), by op name (a ``FloatOp``'s ``function``) and by their calls' names
    (``F.softmax``, ``x.softmax``: ``"softmax"``)."""
    return _island_functions(version())


@functools.cache
def _island_functions(_version: int) -> frozenset:
    return frozenset(name for op in select(op_class="softmax") for name in (op.name,) + _names_of(op))


def kind_names() -> frozenset:
    """The names a routed call can have (:func:`call_names`, :func:`island_functions`): any
    other call passes straight through."""
    return _kind_names(version())


@functools.cache
def _kind_names(_version: int) -> frozenset:
    return frozenset(call_names()) | island_functions()


def _float_tensor(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()


def classify_call(func, args, kwargs) -> tuple[Optional[str], Optional[FloatOp], int, int]:
    """``(kind, op, arity, dim)`` of one torch call: a quantizable tensor-tensor op (kind), or
    the FloatOp of a listed float / passthrough op, or ``(None, None, 0, 0)`` for the rest
    (shapes, scalar arithmetic, dtype queries)."""
    name = getattr(func, "__name__", "")
    fop = call_names().get(name)
    form = call_form(fop.name) if fop is not None else None
    if form == "index":
        return _index_call(func, name, args, kwargs)
    if form == "sequence":
        seq = args[0] if args else kwargs.get("tensors", ())
        dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
        if isinstance(seq, (list, tuple)) and len(seq) >= 2 and all(_float_tensor(t) for t in seq):
            return fop.name, None, len(seq), int(dim)
        return None, None, 0, 0
    if form == "sampling":
        two = len(args) >= 2 and _float_tensor(args[0]) and _float_tensor(args[1])
        return (fop.name, None, 2, 0) if two else (None, None, 0, 0)
    if form == "operands":
        two = len(args) >= 2 and _float_tensor(args[0]) and _float_tensor(args[1])
        same = two and args[0].dim() > 0 and args[1].dim() > 0
        if same and kwargs.get("alpha") is None and len(args) == 2:
            return fop.name, None, 2, 0
        return None, _float_arithmetic(name, args), 0, 0
    if name in _ARITHMETIC:
        return None, _float_arithmetic(name, args), 0, 0
    if name == "sum" and args and _float_tensor(args[0]) and args[0].dim() > 0:
        return None, FloatOp("float", "reduce", "sum"), 0, 0
    node = _Stub(func, name, args, kwargs)
    op = classify_node(node)
    return None, op, 0, 0


def _is_method(func, name: str) -> bool:
    """``func`` is a Tensor method (``x.index_add_``), not a torch function (``torch.index_add``)."""
    return getattr(func, "__objclass__", None) in _TENSOR_CLASSES or getattr(torch.Tensor, name, None) is func


def index_call(func, args, kwargs):
    """``("scatter_add", (kind, dim, x, index, src, in_place))`` or ``("gather", (kind, dim, x,
    index))`` for a scatter-add / gather call that ``QScatterAdd`` / ``QGather`` computes
    (``dal.nn.scatter_add.scatter_call``, ``dal.nn.gather.gather_call_args``), else None."""
    name = getattr(func, "__name__", "")
    method = _is_method(func, name)
    target = name if method else func
    fop = call_names().get(name)
    if fop is None or call_form(fop.name) != "index":
        return None
    if fop.name == "scatter_add":
        sc = scatter_call(target, tuple(args), dict(kwargs), method)
        return ("scatter_add", sc) if sc is not None else None
    gc = gather_call_args(target, tuple(args), dict(kwargs), method)
    return ("gather", gc) if gc is not None else None


def _index_call(func, name, args, kwargs) -> tuple[Optional[str], Optional[FloatOp], int, int]:
    """classify_call for a scatter-add / gather spelling: kind "scatter_add" / "gather" when its
    data is a float tensor and its index a tensor (an integer index is checked by the module, a
    float one refused there, naming it), with the host FloatOp kept for a site no rule quantizes;
    integer data (positions, counts) is no site."""
    op = classify_node(_Stub(func, name, args, kwargs))
    call = index_call(func, args, kwargs)
    if call is None:
        return None, op, 0, 0
    kind, parts = call
    x, index = parts[2], parts[3]
    if not (_float_tensor(x) and torch.is_tensor(index)):
        return None, op, 0, 0
    if kind == "scatter_add" and not _float_tensor(parts[4]):
        return None, op, 0, 0
    return kind, op or FloatOp("float", kind, parts[0]), 0, int(parts[1])


#: element-wise arithmetic no QAT module computes (a QAdd / QMul takes two float tensors)
_ARITHMETIC = {"sub", "__sub__", "__rsub__", "__isub__", "sub_", "rsub", "div", "__truediv__", "__rtruediv__",
               "__itruediv__", "div_", "true_divide"}


def _float_arithmetic(name: str, args) -> Optional[FloatOp]:
    """The float op ``float_<op>`` (op class ``elementwise``) of an add / mul / sub / div that no
    QAT module computes: a float tensor of rank >= 1 with a Python number or an integer tensor
    (Deformable-DETR's ``2 * loc - 1``, ``offsets / offset_normalizer``), or two float tensors that
    are not a QAdd / QMul (a sub, a div). It stays a float node in the export, which the hardware
    check lists or refuses by path. Integer-only arithmetic (shapes, indices) is no op: None."""
    tensors = [a for a in args[:2] if torch.is_tensor(a)]
    if not any(_float_tensor(t) and t.dim() > 0 for t in tensors):
        return None
    base, in_place, reflected = arithmetic_spelling(name)
    neutral = _neutral(base)
    if neutral is not None and not in_place and len(args) == 2 and (neutral[1] or not reflected):
        first = 0 if neutral[1] else 1  # 0 - x is no x, nor is a reflected x.__rsub__(0)
        if any(type(a) is int and a == neutral[0] for a in args[first:]):
            return None  # x + 0, 0 + x, x - 0, x * 1, 1 * x: the exporter writes no node (export/SPEC.md §5a)
    return FloatOp("float", "elementwise", "float_" + base)


def arithmetic_spelling(name: str) -> tuple[str, bool, bool]:
    """``(op, in_place, reflected)`` of an arithmetic call's name: the Tensor method or torch
    function name with its operator underscores, in-place ``i`` / ``_`` and reflected ``r``
    taken off (``"__iadd__"`` -> ``("add", True, False)``, ``"__rsub__"`` and ``torch.rsub`` ->
    ``("sub", False, True)``, ``"mul_"`` -> ``("mul", True, False)``); true division is
    ``"div"``."""
    dunder = name.startswith("__") and name.endswith("__") and len(name) > 4
    core = name[2:-2] if dunder else name
    in_place = core.endswith("_") or (dunder and core.startswith("i"))
    core = core.rstrip("_")
    reflected = core.startswith("r")
    core = core[1:] if reflected or in_place and dunder else core
    return _ALIASES.get(core, core), in_place, reflected


#: another name of an arithmetic op (Python's ``/`` is ``truediv``; torch.true_divide)
_ALIASES = {"truediv": "div", "true_divide": "div"}


def _neutral(op_name: str):
    """The registered op's ``neutral`` (dal.ops: ``(n, both_sides)``), None for another name."""
    try:
        return get(op_name).neutral
    except KeyError:
        return None


#: the classes whose methods are tensor methods (torch.Tensor and its C base class), not ``object``
_TENSOR_CLASSES = tuple(c for c in torch.Tensor.__mro__ if c is not object)


class _Stub:
    """An fx-node look-alike, so that ``float_ops.classify_node`` (one table) decides."""

    def __init__(self, func, name, args, kwargs):
        is_method = _is_method(func, name)
        self.op = "call_method" if is_method else "call_function"
        self.target = name if is_method else func
        self.args, self.kwargs = args, kwargs
