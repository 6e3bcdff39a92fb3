"""What one torch call is, for call-site capture (``call_sites``): a quantizable tensor-tensor op
(add, mul, cat, matmul, grid_sample, scatter-add, gather), a listed float op (``FloatOp``), or
nothing prepare lists (shapes, scalar and integer arithmetic, dtype queries).

:func:`classify_call` decides from the function's name and its arguments only; the names a
routed call can have are :data:`KIND_NAMES`, so the capture mode lets every other call pass
before reading a frame.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..nn.gather import GATHER_METHODS, gather_call_args
from ..nn.scatter_add import SCATTER_METHODS, scatter_call
from .float_ops import FloatOp, classify_node

ADD_NAMES = {"add", "__add__", "__radd__", "__iadd__", "add_"}
MUL_NAMES = {"mul", "__mul__", "__rmul__", "__imul__", "mul_"}
CAT_NAMES = {"cat", "concat", "concatenate"}
MATMUL_NAMES = {"matmul", "__matmul__", "bmm"}
GRID_SAMPLE_NAMES = {"grid_sample", "grid_sampler"}  # F.grid_sample, torch.grid_sampler (dal.nn.grid_sample)
#: scatter-adds (dal.nn.scatter_add: index_put_ with accumulate, scatter_add, index_add) and gathers
#: on codes (dal.nn.gather: gather, index_select, take_along_dim), as functions and as methods
SCATTER_NAMES = frozenset(SCATTER_METHODS)
GATHER_NAMES = frozenset(GATHER_METHODS)
#: float functions routed to an FP16 island (``fp16_island.Fp16Function``) where the hardware check
#: made their site one: the softmax class (an attention's weights, Deformable-DETR's MSDA)
ISLAND_FUNCTIONS = frozenset({"softmax", "log_softmax"})
#: the names a routed call can have: any other call passes straight through
KIND_NAMES = frozenset(ADD_NAMES | MUL_NAMES | CAT_NAMES | MATMUL_NAMES | GRID_SAMPLE_NAMES | SCATTER_NAMES | GATHER_NAMES
                        | ISLAND_FUNCTIONS)


def _float_tensor(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()


def classify_call(func, args, kwargs) -> tuple[Optional[str], Optional[FloatOp], int, int]:
    """``(kind, op, arity, dim)`` of one torch call: a quantizable tensor-tensor op (kind), or
    the FloatOp of a listed float / passthrough op, or ``(None, None, 0, 0)`` for the rest
    (shapes, scalar arithmetic, dtype queries)."""
    name = getattr(func, "__name__", "")
    if name in SCATTER_NAMES or name in GATHER_NAMES:
        return _index_call(func, name, args, kwargs)
    if name in CAT_NAMES:
        seq = args[0] if args else kwargs.get("tensors", ())
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if isinstance(seq, (list, tuple)) and len(seq) >= 2 and all(_float_tensor(t) for t in seq):
            return "cat", None, len(seq), int(dim)
        return None, None, 0, 0
    if name in GRID_SAMPLE_NAMES:
        two = len(args) >= 2 and _float_tensor(args[0]) and _float_tensor(args[1])
        return ("grid_sample", None, 2, 0) if two else (None, None, 0, 0)
    for kind, names in (("add", ADD_NAMES), ("mul", MUL_NAMES), ("matmul", MATMUL_NAMES)):
        if name in names:
            two = len(args) >= 2 and _float_tensor(args[0]) and _float_tensor(args[1])
            same = two and args[0].dim() > 0 and args[1].dim() > 0
            if same and kwargs.get("alpha") is None and len(args) == 2:
                return kind, None, 2, 0
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
    sc = scatter_call(target, tuple(args), dict(kwargs), method) if name in SCATTER_NAMES else None
    if sc is not None:
        return "scatter_add", sc
    gc = gather_call_args(target, tuple(args), dict(kwargs), method) if name in GATHER_NAMES else None
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
    if name in _NEUTRAL and len(args) == 2 and any(type(a) is int and a == _NEUTRAL[name] for a in args[_FIRST[name]:]):
        return None  # x + 0, 0 + x, x - 0, x * 1, 1 * x: the exporter writes no node (export/SPEC.md §5a)
    base = name.strip("_")
    base = base[1:] if base in ("iadd", "imul", "isub", "itruediv") else base
    return FloatOp("float", "elementwise", "float_" + _BASE_OP.get(base, base))


#: out-of-place arithmetic with a neutral Python int (which operand may be it: from _FIRST on)
_NEUTRAL = {"add": 0, "__add__": 0, "__radd__": 0, "sub": 0, "__sub__": 0, "mul": 1, "__mul__": 1, "__rmul__": 1}
_FIRST = {"add": 0, "__add__": 0, "__radd__": 0, "sub": 1, "__sub__": 1, "mul": 0, "__mul__": 0, "__rmul__": 0}
_BASE_OP = {"radd": "add", "rmul": "mul", "rsub": "sub", "truediv": "div", "rtruediv": "div", "true_divide": "div"}


#: the classes whose methods are tensor methods (torch.Tensor and its C base class), not ``object``
_TENSOR_CLASSES = tuple(c for c in torch.Tensor.__mro__ if c is not object)


class _Stub:
    """An fx-node look-alike, so that ``float_ops.classify_node`` (one table) decides."""

    def __init__(self, func, name, args, kwargs):
        is_method = _is_method(func, name)
        self.op = "call_method" if is_method else "call_function"
        self.target = name if is_method else func
        self.args, self.kwargs = args, kwargs
