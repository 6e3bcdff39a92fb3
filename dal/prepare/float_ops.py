"""What the export will hold besides the quantized layers, and whether the hardware can run it.

Every module and functional call that prepare does not quantize is one of:

* **passthrough** — exact on integer codes, so the NPU runs it between the quantizers around
  it: ReLU / ReLU6 / Hardtanh (clip a code range), max pooling (selects a code), reshape-like
  ops, dropout and identity (nothing in eval), nearest resize (copies codes);
* **float** — a float op in the exported graph: a non-linear activation (SiLU, Sigmoid, GELU,
  ...), average pooling, softmax, a normalisation that was not folded (BatchNorm, GroupNorm,
  LayerNorm), a non-nearest resize, a module with parameters and no QAT class (LSTM).

:func:`hardware_verdict` decides, for a float op, what the hardware model says: it runs it
(in FP16 per ``fp16_ops``, on the vector engine for integer pooling), or it cannot — then the
caller refuses it by path with the fix (a replacement rule such as ``lut_activation``, or a
``skip: true`` rule that accepts it running off the NPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from ..hardware.op_classes import HOST_OP_CLASSES
from ..ops import Op, all_ops, by_call, by_function, by_method, by_module
from ..ops import normalization as _normalization

# The ops come from dal's op registry (dal.ops): an op of handling "passthrough" is exact on codes,
# one of handling "float" a float op (a resize either, by its mode), one of a host op class a host
# op (a compare only with an integer operand; an unquantized gather / scatter-add call too).


def float_op_of(op: Op) -> tuple[str, str]:
    """``(op class, function)`` of a float op as prepare lists it: the op's ``op_class``
    (``norm`` for a normalisation no hardware op class names: batch, group, instance norm) and
    its ``function`` (else its name): ``sigmoid`` -> ``("activation", "sigmoid")``,
    ``avg_pool`` / ``mean`` -> ``("pool", "average")``."""
    op_class = "norm" if op.op_class == "custom" and op in _normalization.OPS else op.op_class
    return op_class, op.function or op.name


def _is_float(op: Optional[Op]) -> bool:
    """A float op with one function whatever its arguments (a resize depends on its mode)."""
    return op is not None and op.handling == "float" and op.op_class != "resize"


def _host_class(op: Optional[Op]) -> bool:
    """An op of a host op class that prepare lists as a host op when it reaches float_ops: the
    host ops, and the gather / scatter-add calls no recipe rule quantizes (their call form is
    ``index``: dal.prepare.functional_ops)."""
    if op is None or op.op_class not in HOST_OP_CLASSES:
        return False
    if op.handling == "host":
        return True
    from .functional_ops import call_form

    return op.handling == "functional" and call_form(op.name) == "index"


#: the spellings of gather / scatter-add (by op name) that are no host op when no rule quantizes
#: them: ``index_select`` picks whole rows (ONNX Gather, like ``x[idx]``), ``index_put`` writes
#: unless ``accumulate=True``; the others are element-wise (GatherElements / ScatterElements)
_NOT_HOST_SPELLINGS = {"gather": ("index_select",), "scatter_add": ("index_put",)}


def _host_name(op: Op, pattern) -> Optional[str]:
    """The function a host call is listed as: the op's name for an op of its own (``torch.less``
    -> ``lt``), the call's own name for a gather / scatter-add spelling (``index_add_`` ->
    ``index_add``); None for a spelling that is no host op (:data:`_NOT_HOST_SPELLINGS`)."""
    if op.handling == "host":
        return op.function or op.name
    name = (pattern if isinstance(pattern, str) else getattr(pattern, "__name__", str(pattern))).strip("_")
    return None if name in _NOT_HOST_SPELLINGS.get(op.name, ()) else name


def passthrough_modules() -> tuple:
    """Module types that are exact on codes: the modules of the passthrough ops."""
    return tuple(t for op in all_ops() if op.handling == "passthrough" for t in op.modules)


def float_modules() -> dict[type, tuple[str, str]]:
    """Module type -> ``(op class, function)`` (:func:`float_op_of`): the modules of the float
    ops (not resizes) and of the relu-likes."""
    return {t: float_op_of(op) for op in all_ops() if _is_float(op) or _relu_like_op(op) for t in op.modules}


def __getattr__(name: str):
    """``PASSTHROUGH_MODULES`` and ``FLOAT_MODULES`` (:func:`passthrough_modules`,
    :func:`float_modules`), derived from dal.ops when read."""
    if name == "PASSTHROUGH_MODULES":
        return passthrough_modules()
    if name == "FLOAT_MODULES":
        return float_modules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _relu_like_op(op: Op) -> bool:
    """A relu-like (relu, relu6, hardtanh): an activation exact on codes."""
    return op.op_class == "activation" and op.handling == "passthrough"


def relu_like(fn: str) -> bool:
    """``fn`` is the function of a relu-like (relu, relu6, hardtanh: dal.ops' passthrough
    activations), exact on integer codes."""
    return any(_relu_like_op(op) and (op.function or op.name) == fn for op in all_ops())


@dataclass(frozen=True)
class FloatOp:
    """How an op that prepare does not quantize runs: ``kind`` is "passthrough" or "float";
    ``op_class`` the hardware op class (or "norm", "custom"); ``function`` what it computes."""

    kind: str
    op_class: str
    function: str


def _module_op(mod: nn.Module, want: Callable[[Op], bool]) -> Optional[Op]:
    """The op of the first class in ``type(mod)``'s MRO whose op satisfies ``want``, or None."""
    for cls in type(mod).__mro__:
        op = by_module(cls)
        if op is not None and want(op):
            return op
    return None


def classify_module(mod: nn.Module) -> Optional[FloatOp]:
    """The :class:`FloatOp` of a leaf module prepare leaves as it is; None for containers. By the
    op of its type or a base type (dal.ops), in this order: passthrough, host (a 3-D conv),
    resize (passthrough for mode nearest), float; else a module with parameters of its own is a
    ``custom`` float op."""
    if _module_op(mod, lambda op: op.handling == "passthrough") is not None:
        return FloatOp("passthrough", "passthrough", type(mod).__name__)
    host = _module_op(mod, lambda op: op.handling == "host")
    if host is not None:
        return FloatOp("float", host.op_class, type(mod).__name__)
    if _module_op(mod, lambda op: op.op_class == "resize") is not None:
        mode = str(mod.mode)
        return FloatOp("passthrough" if mode == "nearest" else "float", "resize", mode)
    op = _module_op(mod, _is_float)
    if op is not None:
        return FloatOp("float", *float_op_of(op))
    if next(mod.parameters(recurse=False), None) is not None:
        return FloatOp("float", "custom", type(mod).__name__)
    return None


def classify_node(node) -> Optional[FloatOp]:
    """The :class:`FloatOp` of a traced ``call_function`` / ``call_method`` node (None: not a
    tensor op worth listing, e.g. ``size()``), by the op its target or method name belongs to
    (dal.ops). ``node`` may also be a call-site stub whose arguments are real tensors
    (call_sites.py)."""
    host = _host_op(node)
    if host is not None:
        return host
    if node.op == "call_function":
        target = node.target
        op = by_function(target)
        if op is not None and op.handling == "passthrough":
            return FloatOp("passthrough", "passthrough", getattr(target, "__name__", str(target)))
        if _stochastic_depth(target):
            return FloatOp("passthrough", "passthrough", "stochastic_depth")
        if _is_float(op):
            return FloatOp("float", *float_op_of(op))
        if op is not None and op.op_class == "resize":  # F.interpolate
            mode = str(node.kwargs.get("mode", node.args[3] if len(node.args) > 3 else "nearest"))
            return FloatOp("passthrough" if mode == "nearest" else "float", "resize", mode)
        return None
    if node.op == "call_method":
        op = by_method(node.target)
        if op is not None and op.handling == "passthrough":
            return FloatOp("passthrough", "passthrough", node.target)
        if _is_float(op):
            return FloatOp("float", *float_op_of(op))
    return None


def _stochastic_depth(target) -> bool:
    """torchvision's ``stochastic_depth`` (a leaf of fx traces: ``torch.fx.wrap``): dropout of a
    whole residual branch, the identity in eval and in the export (EfficientNet, Swin, ConvNeXt).
    Recognised by name: torchvision is not imported here."""
    return getattr(target, "__name__", "") == "stochastic_depth" and \
        getattr(target, "__module__", "") == "torchvision.ops.stochastic_depth"


def _host_op(node) -> Optional[FloatOp]:
    """The FloatOp of a host op class (nonzero, gather, scan, sort, conv3d, scatter_add; a
    compare with an integer or bool operand), else None."""
    op = by_call(node.op, node.target) if node.op in ("call_function", "call_method") else None
    if not _host_class(op):
        return None
    if op.op_class == "compare":
        return FloatOp("float", "compare", op.name) if any(integer_operand(a) for a in node.args[:2]) else None
    name = _host_name(op, node.target)
    return FloatOp("float", op.op_class, name) if name is not None else None


def _hashable(target) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


#: calls whose result is an integer tensor whatever their inputs
_INT_RESULT_FUNCTIONS = {torch.arange, torch.argmax, torch.argmin, torch.argsort, torch.nonzero, torch.argwhere}
_INT_RESULT_METHODS = {"long", "int", "short", "bool", "argmax", "argmin", "argsort", "nonzero"}
#: calls whose result is integer when every tensor input is
_INT_KEEPING = {"__getitem__", "unsqueeze", "squeeze", "view", "reshape", "expand", "expand_as", "flatten",
                "permute", "transpose", "t", "contiguous", "clone", "repeat", "flip", "add", "sub", "mul",
                "__add__", "__sub__", "__mul__", "__radd__", "__rsub__", "__rmul__", "neg", "abs"}
_INTEGER_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool}


def integer_operand(value) -> bool:
    """Is ``value`` an integer or bool tensor computed from the model's inputs? A real tensor (a
    call-site stub's argument) by its dtype; an fx node by what computes it: ``arange`` of a size,
    ``argmax`` / ``argsort`` / ``nonzero``, ``.long()`` / ``.bool()``, and indexing, reshapes and
    integer arithmetic of those (a compare of constants is folded by the exporter, so it is not
    one)."""
    if isinstance(value, torch.Tensor):
        return value.dtype in _INTEGER_DTYPES
    if not (hasattr(value, "op") and hasattr(value, "target") and hasattr(value, "args")):
        return False
    return _integer_node(value, {}) and _reads_input(value, {})


def _node_args(node):
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (list, tuple)):
            out += [x for x in a if hasattr(x, "op")]
        elif hasattr(a, "op"):
            out.append(a)
    return out


def _integer_node(node, memo) -> bool:
    if node in memo:
        return memo[node]
    memo[node] = False
    dtype = node.kwargs.get("dtype")
    if node.op == "call_function" and _hashable(node.target) and node.target in _INT_RESULT_FUNCTIONS:
        ok = dtype is None or dtype in _INTEGER_DTYPES
        if node.target is torch.arange:  # a float start / end / step makes a float arange
            ok = ok and not any(isinstance(a, float) for a in node.args)
    elif node.op == "call_method" and node.target in _INT_RESULT_METHODS:
        ok = True
    elif node.op == "call_method" and node.target == "to":
        ok = any(a in _INTEGER_DTYPES for a in list(node.args[1:]) + [dtype])
    elif node.op in ("call_function", "call_method"):
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        name = "__getitem__" if name == "getitem" else name
        ins = [a for a in _node_args(node) if a.op != "get_attr"]
        ok = name in _INT_KEEPING and bool(ins) and all(_integer_node(a, memo) for a in ins[:1])
    else:
        ok = False
    memo[node] = ok
    return ok


def _reads_input(node, memo) -> bool:
    """``node`` depends on a placeholder (the forward's arguments), not only on constants."""
    if node in memo:
        return memo[node]
    memo[node] = node.op == "placeholder"
    if node.op not in ("placeholder", "get_attr"):
        memo[node] = any(_reads_input(a, memo) for a in _node_args(node))
    return memo[node]


def hardware_verdict(hw, op: FloatOp) -> tuple[bool, str]:
    """``(runs, text)``: whether hardware ``hw`` runs the float op ``op``, and how (or the fix).

    Runs: an activation or softmax / layer norm listed in ``fp16_ops`` (an FP16 island), an
    average pool on hardware whose ``pool`` op class takes integer formats (the vector engine
    averages codes), a resize whose mode is in ``resize_modes``. Everything else cannot run on
    the NPU; ``text`` then says what would fix it."""
    fn, fp16 = op.function, set(getattr(hw, "fp16_ops", ()) or ())
    if op.kind == "passthrough" or relu_like(fn):
        return True, "exact on integer codes"
    if op.op_class in ("activation", "softmax", "layernorm") and fn.replace("log_", "") in fp16:
        return True, f"runs in FP16 on {hw.name} (fp16_ops)"
    if op.op_class == "pool" and hw.op("pool") is not None:
        on = "in fp16" if hw.compute_precision("pool") == "fp16" else "integer codes"
        return True, f"averages {on} on {hw.name}'s {hw.op('pool').engine} engine"
    if op.op_class == "resize" and fn in (getattr(hw, "resize_modes", ()) or ()):
        return True, f"{fn} resize on {hw.name}"
    skip = "or a rule {match: <this path>, skip: true} to run it off the NPU"
    if op.op_class == "activation" and fn in (getattr(hw, "lut_ops", ()) or ()):
        return False, f"{hw.name} runs {fn} only through a lookup table: add lut_activation to the recipe's " \
                      f"replace: list, {skip}"
    if op.op_class == "resize":
        return False, f"{hw.name} resizes only with {', '.join(hw.resize_modes) or 'no mode'}: add " \
                      f"upsample_nearest to the recipe's replace: list, {skip}"
    if op.op_class == "layernorm":
        return False, f"{hw.name} has no FP16 layer norm: {skip}"
    if fn in ("groupnorm", "instancenorm"):
        return False, f"{hw.name} has no FP16 engine for {fn}: replace the layer by a BatchNorm2d (it folds into " \
                      f"the conv before it, or runs as a quantized per-channel affine), {skip}"
    if fn == "batchnorm":
        return False, f"{hw.name} has no float batch norm: put it right after the Conv2d it follows in a " \
                      f"forward torch.fx can trace so that it folds, {skip}"
    if op.op_class == "custom":
        return False, f"{hw.name} cannot run a float {fn}: register a QAT module for it " \
                      f"(@dal.register_qat_module({fn})), {skip}"
    return False, f"{hw.name} does not run {fn} ({op.op_class}) in float: {skip}"
