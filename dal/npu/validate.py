"""Load-time checks of a graph's quantization parameters, before anything is allocated.

Every QuantizeLinear / DequantizeLinear whose scale is a constant must have scales that are
finite and > 0 (a zero scale divides by zero, a NaN or negative one silently returns garbage),
and a zero point of the codes' type whose shape matches the scale's. Scales computed at run
time are checked by the op itself (``check_scale``). Errors name the node and the tensor.
"""
from __future__ import annotations

import numpy as np

from .errors import NPUError


def check_scale(s: np.ndarray, node, what: str = "scale") -> None:
    """NPUError naming ``node`` unless every element of the float scale ``s`` is finite and > 0."""
    s = np.asarray(s)
    if s.dtype.kind != "f":
        return  # the op reports a wrong scale type itself
    bad = ~(np.isfinite(s) & (s > 0))
    if np.any(bad):
        v = s.reshape(-1)[np.argmax(bad.reshape(-1))]
        raise NPUError(f"node {node.name!r} ({node.op_type}): {what} must be finite and > 0, "
                       f"got {v!r} ({int(bad.sum())} of {s.size} elements)")


def check_quant_nodes(g) -> None:
    """Scale and zero-point checks of every Q/DQ node with constant parameters (see module doc)."""
    for n in g.nodes:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or n.domain not in ("", "ai.onnx"):
            continue
        if len(n.input) < 2 or not n.input[1]:
            raise NPUError(f"node {n.name!r} ({n.op_type}) has no scale input")
        s = g.consts.get(n.input[1])
        if s is not None:
            check_scale(s, n, f"scale {n.input[1]!r}")
        z = g.consts.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        if z is None or s is None:
            continue
        if z.size != s.size or (z.ndim != s.ndim and z.size != 1):
            raise NPUError(f"node {n.name!r} ({n.op_type}): zero point {n.input[2]!r} of shape "
                           f"{list(z.shape)} does not match scale {n.input[1]!r} of shape {list(s.shape)}")
        if n.op_type == "DequantizeLinear":
            x = g.consts.get(n.input[0])
            if x is not None and x.dtype.kind in "iu" and x.dtype != z.dtype:  # floats: the op refuses them
                raise NPUError(f"node {n.name!r} ({n.op_type}): zero point {n.input[2]!r} is "
                               f"{z.dtype}, the codes {n.input[0]!r} are {x.dtype}")


def check_group(node, group, x_channels, w_shape) -> None:
    """Conv ``group`` against the weight (and the input's channels when known), before any
    per-group work: group in [1, O], O % group == 0, C == C/g * group."""
    o = int(w_shape[0]) if len(w_shape) else 0
    if not isinstance(group, (int, np.integer)) or group < 1 or group > max(o, 1) or o % group:
        raise NPUError(f"node {node.name!r} ({node.op_type}): group {group} must be in [1, {o}] "
                       f"and divide the {o} output channels of weight {list(w_shape)}")
    if x_channels is not None and len(w_shape) > 1 and x_channels != w_shape[1] * group:
        raise NPUError(f"node {node.name!r} ({node.op_type}): input has {x_channels} channels, "
                       f"weight {list(w_shape)} with group {group} needs {w_shape[1] * group}")


def check_claimed_types(g) -> None:
    """UnsupportedNode, naming the first node that reads it, for a graph input or initializer
    of an element type dal does not claim (tensors.NOT_CLAIMED: int2, uint2, float4e2m1,
    float8e8m0, float6), and for a node whose ``to`` / ``output_dtype`` asks for one."""
    from .errors import UnsupportedNode
    from .tensors import NOT_CLAIMED
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in g.model.graph.input}
    elem.update({t.name: t.data_type for t in g.model.graph.initializer})
    for name, t in elem.items():
        if t in NOT_CLAIMED:
            users = g.consumers(name)
            why = f"{name!r} is {NOT_CLAIMED[t]}, which is not a dal format (dal.npu does not implement it)"
            if users:
                raise UnsupportedNode(users[0], [NOT_CLAIMED[t].lower()], why)
            raise NPUError(why)
    for n in g.nodes:
        a = g.attrs(n)
        for key in ("to", "output_dtype"):
            if isinstance(a.get(key), int) and a[key] in NOT_CLAIMED:
                raise UnsupportedNode(n, [], f"{key}={NOT_CLAIMED[a[key]]} is not a dal format "
                                             "(dal.npu does not implement it)")


MAX_ELEMENTS = 1 << 31  # no tensor a step produces may exceed this (the kernels index in int64)


def _check_resize(node, ins, a):
    """Resize: scales finite and > 0, output sizes >= 0, and the output no larger than
    MAX_ELEMENTS, before the op allocates it (a scale of 1e9 read from a mistyped tensor
    would otherwise ask for gigabytes)."""
    x = ins[0] if ins else None
    if x is None:
        return
    scales = ins[2] if len(ins) > 2 and ins[2] is not None and np.asarray(ins[2]).size else None
    sizes = ins[3] if len(ins) > 3 and ins[3] is not None and np.asarray(ins[3]).size else None
    if len(ins) == 2:  # opset 10: (X, scales)
        scales = ins[1]
    if sizes is not None:
        out = np.asarray(sizes).reshape(-1).astype(np.float64)
    elif scales is not None:
        s = np.asarray(scales).reshape(-1)
        if s.dtype.kind != "f" or not np.all(np.isfinite(s) & (s > 0)):
            raise NPUError(f"node {node.name!r} (Resize): scales {s.tolist()[:8]} must be finite and > 0 floats")
        if s.size != x.ndim:
            return  # the op reports the rank mismatch itself
        out = np.floor(np.asarray(x.shape, np.float64) * s.astype(np.float64))
    else:
        return
    if np.any(out < 0) or float(np.prod(np.maximum(out, 0))) > MAX_ELEMENTS:
        raise NPUError(f"node {node.name!r} (Resize): output shape {out.astype(np.int64).tolist()} is "
                       f"negative or over {MAX_ELEMENTS} elements")


PRECHECKS = {"Resize": _check_resize}


def precheck(node, ins, attrs) -> None:
    """Checks of a node's run-time inputs that must happen before its op allocates anything."""
    f = PRECHECKS.get(node.op_type)
    if f is not None:
        f(node, ins, attrs)
