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

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..hardware.op_classes import ACTIVATION_OF_TYPE

#: module types that are exact on codes
PASSTHROUGH_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                       nn.Dropout3d, nn.AlphaDropout, nn.Flatten, nn.Unflatten, nn.MaxPool1d, nn.MaxPool2d,
                       nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
                       nn.ChannelShuffle, nn.PixelShuffle, nn.PixelUnshuffle, nn.ZeroPad2d)

#: module type -> (op class, function) for float ops
#: (activations come from ``dal.hardware.op_classes.ACTIVATION_OF_TYPE``, by class name)
FLOAT_MODULES: dict[type, tuple[str, str]] = {
    **{getattr(nn, name): ("activation", fn) for name, fn in ACTIVATION_OF_TYPE.items()},
    nn.AvgPool1d: ("pool", "average"), nn.AvgPool2d: ("pool", "average"), nn.AvgPool3d: ("pool", "average"),
    nn.AdaptiveAvgPool1d: ("pool", "average"), nn.AdaptiveAvgPool2d: ("pool", "average"),
    nn.AdaptiveAvgPool3d: ("pool", "average"),
    nn.Softmax: ("softmax", "softmax"), nn.LogSoftmax: ("softmax", "log_softmax"),
    nn.LayerNorm: ("layernorm", "layernorm"), nn.GroupNorm: ("norm", "groupnorm"),
    nn.InstanceNorm1d: ("norm", "instancenorm"), nn.InstanceNorm2d: ("norm", "instancenorm"),
    nn.BatchNorm1d: ("norm", "batchnorm"), nn.BatchNorm2d: ("norm", "batchnorm"),
    nn.BatchNorm3d: ("norm", "batchnorm"),
}

_PASSTHROUGH_FUNCTIONS = {F.relu, torch.relu, torch.relu_, F.relu6, F.hardtanh, torch.flatten, torch.reshape,
                          torch.permute, torch.transpose, torch.squeeze, torch.unsqueeze, torch.chunk, torch.split,
                          F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool2d, F.dropout, F.pad,
                          operator.getitem, torch.clamp, torch.clip, torch.stack, torch.narrow, torch.t}
_PASSTHROUGH_METHODS = {"relu", "relu_", "flatten", "reshape", "view", "permute", "transpose", "contiguous",
                        "squeeze", "unsqueeze", "chunk", "split", "expand", "expand_as", "clamp", "clamp_",
                        "clip", "t", "narrow", "flip", "repeat", "view_as", "reshape_as", "__getitem__",
                        "to", "float", "type_as", "detach", "clone", "unbind", "movedim"}
_FLOAT_FUNCTIONS = {
    torch.sigmoid: ("activation", "sigmoid"), F.sigmoid: ("activation", "sigmoid"), F.silu: ("activation", "silu"),
    F.gelu: ("activation", "gelu"), torch.tanh: ("activation", "tanh"), F.tanh: ("activation", "tanh"),
    F.hardswish: ("activation", "hardswish"), F.hardsigmoid: ("activation", "hardsigmoid"),
    F.elu: ("activation", "elu"), F.leaky_relu: ("activation", "leaky_relu"), F.mish: ("activation", "mish"),
    F.softplus: ("activation", "softplus"), torch.exp: ("activation", "exp"),
    F.softmax: ("softmax", "softmax"), torch.softmax: ("softmax", "softmax"),
    F.log_softmax: ("softmax", "log_softmax"), F.layer_norm: ("layernorm", "layernorm"),
    F.group_norm: ("norm", "groupnorm"), F.batch_norm: ("norm", "batchnorm"),
    F.instance_norm: ("norm", "instancenorm"),
    F.avg_pool2d: ("pool", "average"), F.adaptive_avg_pool2d: ("pool", "average"),
    F.adaptive_avg_pool1d: ("pool", "average"), torch.mean: ("pool", "average"),
}
_FLOAT_METHODS = {"sigmoid": ("activation", "sigmoid"), "tanh": ("activation", "tanh"),
                  "exp": ("activation", "exp"), "softmax": ("softmax", "softmax"), "mean": ("pool", "average")}
#: ops of the host op classes (dal.hardware.op_classes.HOST_OP_CLASSES): function -> (op class, name)
_HOST_FUNCTIONS = {
    torch.nonzero: ("nonzero", "nonzero"), torch.argwhere: ("nonzero", "argwhere"),
    torch.masked_select: ("nonzero", "masked_select"), torch.unique: ("nonzero", "unique"),
    torch.gather: ("gather", "gather"), torch.take_along_dim: ("gather", "take_along_dim"),
    torch.cumsum: ("scan", "cumsum"), torch.cumprod: ("scan", "cumprod"), torch.cummax: ("scan", "cummax"),
    torch.cummin: ("scan", "cummin"), F.conv3d: ("conv3d", "conv3d"), torch.conv3d: ("conv3d", "conv3d"),
    torch.sort: ("sort", "sort"), torch.argsort: ("sort", "argsort"), torch.topk: ("sort", "topk"),
    torch.scatter_add: ("scatter_add", "scatter_add"), torch.index_add: ("scatter_add", "index_add"),
}
_HOST_METHODS = {"nonzero": ("nonzero", "nonzero"), "argwhere": ("nonzero", "argwhere"),
                 "masked_select": ("nonzero", "masked_select"), "unique": ("nonzero", "unique"),
                 "gather": ("gather", "gather"), "take_along_dim": ("gather", "take_along_dim"),
                 "cumsum": ("scan", "cumsum"), "cumprod": ("scan", "cumprod"), "sort": ("sort", "sort"),
                 "argsort": ("sort", "argsort"), "topk": ("sort", "topk"),
                 "scatter_add": ("scatter_add", "scatter_add"), "scatter_add_": ("scatter_add", "scatter_add"),
                 "index_add": ("scatter_add", "index_add"), "index_add_": ("scatter_add", "index_add")}
#: compares: a host op (``compare``) when an operand is an integer or bool tensor (integer_operand)
_COMPARE_FUNCTIONS = {operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
                      operator.eq: "eq", operator.ne: "ne", torch.lt: "lt", torch.le: "le", torch.gt: "gt",
                      torch.ge: "ge", torch.eq: "eq", torch.ne: "ne", torch.less: "lt", torch.less_equal: "le",
                      torch.greater: "gt", torch.greater_equal: "ge", torch.not_equal: "ne"}
_COMPARE_METHODS = {m: m.strip("_") for m in ("lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__",
                                                "__ge__", "__eq__", "__ne__")}
_RELU_LIKE = {"relu", "relu6", "hardtanh"}


@dataclass(frozen=True)
class FloatOp:
    """How an op that prepare does not quantize runs: ``kind`` is "passthrough" or "float";
    ``op_class`` the hardware op class (or "norm", "custom"); ``function`` what it computes."""

    kind: str
    op_class: str
    function: str


def classify_module(mod: nn.Module) -> Optional[FloatOp]:
    """The :class:`FloatOp` of a leaf module prepare leaves as it is; None for containers."""
    if isinstance(mod, PASSTHROUGH_MODULES):
        return FloatOp("passthrough", "passthrough", type(mod).__name__)
    if isinstance(mod, (nn.Conv3d, nn.ConvTranspose3d)):
        return FloatOp("float", "conv3d", type(mod).__name__)
    if isinstance(mod, nn.Upsample):
        mode = str(mod.mode)
        return FloatOp("passthrough" if mode == "nearest" else "float", "resize", mode)
    for cls in type(mod).__mro__:
        if cls in FLOAT_MODULES:
            op_class, fn = FLOAT_MODULES[cls]
            return FloatOp("float", op_class, fn)
    if next(mod.parameters(recurse=False), None) is not None:
        return FloatOp("float", "custom", type(mod).__name__)
    return None


def classify_node(node) -> Optional[FloatOp]:
    """The :class:`FloatOp` of a traced ``call_function`` / ``call_method`` node (None: not a
    tensor op worth listing, e.g. ``size()``). ``node`` may also be a call-site stub whose
    arguments are real tensors (call_sites.py)."""
    host = _host_op(node)
    if host is not None:
        return host
    if node.op == "call_function":
        target = node.target
        if target in _PASSTHROUGH_FUNCTIONS:
            return FloatOp("passthrough", "passthrough", getattr(target, "__name__", str(target)))
        if _stochastic_depth(target):
            return FloatOp("passthrough", "passthrough", "stochastic_depth")
        if target in _FLOAT_FUNCTIONS:
            return FloatOp("float", *_FLOAT_FUNCTIONS[target])
        if target is F.interpolate:
            mode = str(node.kwargs.get("mode", node.args[3] if len(node.args) > 3 else "nearest"))
            return FloatOp("passthrough" if mode == "nearest" else "float", "resize", mode)
        return None
    if node.op == "call_method":
        if node.target in _PASSTHROUGH_METHODS:
            return FloatOp("passthrough", "passthrough", node.target)
        if node.target in _FLOAT_METHODS:
            return FloatOp("float", *_FLOAT_METHODS[node.target])
    return None


def _stochastic_depth(target) -> bool:
    """torchvision's ``stochastic_depth`` (a leaf of fx traces: ``torch.fx.wrap``): dropout of a
    whole residual branch, the identity in eval and in the export (EfficientNet, Swin, ConvNeXt).
    Recognised by name: torchvision is not imported here."""
    return getattr(target, "__name__", "") == "stochastic_depth" and \
        getattr(target, "__module__", "") == "torchvision.ops.stochastic_depth"


def _host_op(node) -> Optional[FloatOp]:
    """The FloatOp of a host op class (nonzero, gather, scan, conv3d; a compare with an integer
    or bool operand), else None."""
    if node.op == "call_function":
        found = _HOST_FUNCTIONS.get(node.target) if _hashable(node.target) else None
        compare = _COMPARE_FUNCTIONS.get(node.target) if _hashable(node.target) else None
    elif node.op == "call_method":
        found, compare = _HOST_METHODS.get(node.target), _COMPARE_METHODS.get(node.target)
    else:
        return None
    if found is not None:
        return FloatOp("float", *found)
    if compare is not None and any(integer_operand(a) for a in node.args[:2]):
        return FloatOp("float", "compare", compare)
    return None


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
    if op.kind == "passthrough" or fn in _RELU_LIKE:
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
