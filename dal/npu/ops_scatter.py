"""Indexing ops and the scatter-add integer group (export/SPEC.md §5c, §5d).

Node by node (any element type; an index outside ``[-n, n)`` is an NPUError naming the node, never
an IndexError or a silent wrap):

* ``Gather`` (axis), ``GatherElements`` (axis): copies;
* ``ScatterND`` and ``ScatterElements`` with ``reduction`` none (the last update of a duplicated
  index wins, in update order) or add (float: every contribution summed in float64 with the
  destination, rounded once to the tensor type; integer: the exact sum, refused outside the type).

Integer group (``semantics="integer"``): ``DQ(d codes), DQ(u codes) -> ScatterElements | ScatterND
(reduction add) -> Q`` where both DQs have the same scalar float32 scale ``s`` (bit for bit) and the
same 8-bit zero point ``z``, and the sum is read only by one QuantizeLinear (scalar float32 scale
``s_y``, 8-bit zero point ``z_y``) and is no graph output:

    acc = (d - z) + sum (u - z)      exactly (int64), refused where |acc| >= 2^31 (int32)
    v   = float32(float64(acc) * float64(s))
    y   = clamp(round_half_even(v / s_y) + z_y, qmin, qmax)      (float32 division)

the float requantizer (the file declares ``dal.requantizer`` kind float; another kind is refused).
"""
from __future__ import annotations

import numpy as np

from . import quant
from .errors import NPUError, UnsupportedNode
from .ops_float import op
from .tensors import as_compute_type, is_float

_8BIT = {np.dtype(np.int8), np.dtype(np.uint8)}
_INDEX = (np.int64, np.int32)


def _indices(ctx, idx, n: int, what: str) -> np.ndarray:
    """``idx`` as int64 in ``[0, n)`` (negative counted from the end); NPUError naming the node
    for another type or a value outside ``[-n, n)``."""
    idx = np.asarray(idx)
    if idx.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise NPUError(f"node {ctx.node.name!r} ({ctx.node.op_type}): {what} must be int64 / int32, got {idx.dtype}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise NPUError(f"node {ctx.node.name!r} ({ctx.node.op_type}): {what} out of range: values in "
                       f"[{int(idx.min())}, {int(idx.max())}] for an axis of size {n} (allowed [{-n}, {n - 1}])")
    return np.where(idx < 0, idx + n, idx)


def _axis(ctx, a, rank: int) -> int:
    axis = int(a.get("axis", 0))
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise NPUError(f"node {ctx.node.name!r} ({ctx.node.op_type}): axis {axis} for rank {rank}")
    return axis % max(rank, 1)


def _reduction(ctx, a) -> str:
    r = a.get("reduction", "none")
    r = r.decode() if isinstance(r, bytes) else str(r)
    if r not in ("none", "add"):
        raise UnsupportedNode(ctx.node, [], f"{ctx.node.op_type} reduction {r!r} (none and add only)")
    return r


@op("Gather")
def _gather(ctx, ins, a):
    """ONNX Gather: ``np.take`` along ``axis`` with checked indices."""
    x, idx = np.asarray(ins[0]), ins[1]
    axis = _axis(ctx, a, x.ndim)
    return [np.take(x, _indices(ctx, idx, x.shape[axis], "Gather indices"), axis=axis)]


@op("GatherElements")
def _gather_elements(ctx, ins, a):
    """ONNX GatherElements: ``out[i][j][k] = x[idx[i][j][k]][j][k]`` (axis 0), index of x's rank,
    each other axis no longer than x's."""
    x, idx = np.asarray(ins[0]), np.asarray(ins[1])
    axis = _axis(ctx, a, x.ndim)
    if idx.ndim != x.ndim or any(idx.shape[d] > x.shape[d] for d in range(x.ndim) if d != axis):
        raise NPUError(f"node {ctx.node.name!r} (GatherElements): indices {list(idx.shape)} do not fit data "
                       f"{list(x.shape)} along axis {axis}")
    i = _indices(ctx, idx, x.shape[axis], "GatherElements indices")
    view = x[tuple(slice(0, n) if d != axis else slice(None) for d, n in enumerate(idx.shape))]
    return [np.take_along_axis(view, i, axis=axis)]


def _scatter_positions(ctx, data, idx, updates, elements: bool, axis: int):
    """(flat destination position per update element, updates flattened) in update order."""
    if elements:
        if idx.shape != updates.shape or idx.ndim != data.ndim or \
                any(idx.shape[d] > data.shape[d] for d in range(data.ndim) if d != axis):
            raise NPUError(f"node {ctx.node.name!r} (ScatterElements): indices {list(idx.shape)} and updates "
                           f"{list(updates.shape)} must have one shape, of data's rank, fitting data "
                           f"{list(data.shape)} off axis {axis}")
        i = _indices(ctx, idx, data.shape[axis], "ScatterElements indices")
        coords = list(np.indices(idx.shape, sparse=False))
        coords[axis] = i
        return np.ravel_multi_index(tuple(coords), data.shape).reshape(-1), updates.reshape(-1)
    k = idx.shape[-1] if idx.ndim else 0
    want = tuple(idx.shape[:-1]) + tuple(data.shape[k:])
    if idx.ndim == 0 or k > data.ndim or tuple(updates.shape) != want:
        raise NPUError(f"node {ctx.node.name!r} (ScatterND): updates {list(updates.shape)} must be indices.shape[:-1] "
                       f"+ data.shape[{k}:] = {list(want)} (data {list(data.shape)}, indices {list(idx.shape)})")
    idx = np.asarray(idx)
    if idx.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise NPUError(f"node {ctx.node.name!r} (ScatterND): indices must be int64 / int32, got {idx.dtype}")
    flat = idx.reshape(-1, k).astype(np.int64)
    cols = [_indices(ctx, flat[:, j], data.shape[j], f"ScatterND indices[..., {j}]") for j in range(k)]
    rows = np.ravel_multi_index(tuple(cols), data.shape[:k]) if k else np.zeros(flat.shape[0], np.int64)
    inner = int(np.prod(data.shape[k:], dtype=np.int64))
    pos = (rows[:, None] * inner + np.arange(inner)[None, :]).reshape(-1)
    return pos, updates.reshape(-1)


def scatter(ctx, data, idx, updates, axis, reduction: str, elements: bool) -> np.ndarray:
    """ScatterElements / ScatterND on any element type (module doc)."""
    data, idx, updates = np.asarray(data), np.asarray(idx), np.asarray(updates)
    if updates.dtype != data.dtype:
        raise NPUError(f"node {ctx.node.name!r}: updates {updates.dtype} and data {data.dtype} differ")
    pos, upd = _scatter_positions(ctx, data, idx, updates, elements, axis)
    if reduction == "none":
        out = np.array(data, copy=True).reshape(-1)
        out[pos] = upd  # numpy assigns in order: the last duplicate wins
        return out.reshape(data.shape)
    if is_float(data):
        acc = as_compute_type(data).astype(np.float64).reshape(-1)
        np.add.at(acc, pos, as_compute_type(upd).astype(np.float64))
        return acc.astype(data.dtype).reshape(data.shape)
    acc = data.astype(np.int64).reshape(-1)
    np.add.at(acc, pos, upd.astype(np.int64))
    info = np.iinfo(data.dtype)
    if acc.size and (acc.min() < info.min or acc.max() > info.max):
        raise NPUError(f"node {ctx.node.name!r}: integer scatter-add leaves {data.dtype} "
                       f"([{int(acc.min())}, {int(acc.max())}]); accumulate wide (export/SPEC.md §5c)")
    return acc.astype(data.dtype).reshape(data.shape)


@op("ScatterElements")
def _scatter_elements(ctx, ins, a):
    data, idx, upd = ins
    return [scatter(ctx, data, idx, upd, _axis(ctx, a, np.asarray(data).ndim), _reduction(ctx, a), True)]


@op("ScatterND")
def _scatter_nd(ctx, ins, a):
    data, idx, upd = ins
    return [scatter(ctx, data, idx, upd, 0, _reduction(ctx, a), False)]


# ---- the integer group ---------------------------------------------------------------------
def _dq(g, name):
    n = g.producer(name)
    if n is None or n.op_type != "DequantizeLinear" or len(n.input) < 3:
        return None
    s, z = g.const(n.input[1]), g.const_opt(n, 2)
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != np.float32 or z.dtype not in _8BIT:
        return None
    if g.attrs(n).get("block_size", 0) or not np.isfinite(s).all() or float(s.reshape(())) <= 0:
        return None
    return n, np.float32(s.reshape(())), z.reshape(())


def _q(g, n):
    if n is None or n.op_type != "QuantizeLinear" or len(n.input) < 3:
        return None
    s, z = g.const(n.input[1]), g.const_opt(n, 2)
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != np.float32 or z.dtype not in _8BIT:
        return None
    if g.attrs(n).get("block_size", 0) or g.attrs(n).get("output_dtype", 0):
        return None
    return n, np.float32(s.reshape(())), z.reshape(())


class ScatterAddCodes:
    """The scatter-add integer group (module doc): inputs data codes, indices, update codes."""

    kind = "codes"

    def __init__(self, g, node, dd, du, q, requantizer):
        self.g, self.node, self.node_name = g, node, node.name
        (dn, self.s, self.z), (un, _, _), (qn, self.sy, self.zy) = dd, du, q
        self.inputs = [dn.input[0], node.input[1], un.input[0]]
        self.outputs = [qn.output[0]]
        self.extra_outputs = [node.output[0]]
        self.absorbed = [qn]
        self.elements = node.op_type == "ScatterElements"
        self.requantizer = requantizer

    def run(self, ins, threads, want_extra=False):
        from types import SimpleNamespace
        ctx = SimpleNamespace(node=self.node, opset=self.g.opset, threads=threads)
        attrs = self.g.attrs(self.node)
        if getattr(self.requantizer, "kind", "float") != "float":
            raise NPUError(f"node {self.node_name!r}: the scatter-add group implements the float requantizer only; "
                           f"the file declares {self.requantizer.kind!r}")
        d, idx, u = (np.asarray(v) for v in ins)
        if d.dtype != self.z.dtype or u.dtype != self.z.dtype:
            raise NPUError(f"node {self.node_name!r}: codes {d.dtype} / {u.dtype}, zero point {self.z.dtype}")
        axis = _axis(ctx, attrs, d.ndim) if self.elements else 0
        z = np.int64(self.z)
        acc = scatter(ctx, d.astype(np.int64) - z, idx, u.astype(np.int64) - z, axis, "add", self.elements)
        if acc.size and (acc.min() < -(1 << 31) or acc.max() >= (1 << 31)):
            raise NPUError(f"node {self.node_name!r}: scatter-add accumulator [{int(acc.min())}, {int(acc.max())}] "
                           "leaves int32 (export/SPEC.md §5c)")
        v = (acc.astype(np.float64) * np.float64(self.s)).astype(np.float32)
        y = quant.quantize(v, np.asarray(self.sy, np.float32), np.asarray(self.zy), self.zy.dtype)
        out = {self.outputs[0]: y}
        if want_extra:
            from .ops_float import OPS
            vals = [quant.dequantize(d, np.asarray(self.s), np.asarray(self.z)), idx,
                    quant.dequantize(u, np.asarray(self.s), np.asarray(self.z))]
            out[self.node.output[0]] = OPS[self.node.op_type](ctx, vals, attrs)[0]
        return out


def match(g, node):
    """A :class:`ScatterAddCodes` step for ``node`` when it heads the scatter-add group, else None."""
    if node.op_type not in ("ScatterElements", "ScatterND") or len(node.input) < 3:
        return None
    r = g.attrs(node).get("reduction", "none")
    if (r.decode() if isinstance(r, bytes) else str(r)) != "add":
        return None
    dd, du = _dq(g, node.input[0]), _dq(g, node.input[2])
    if dd is None or du is None or dd[1].tobytes() != du[1].tobytes() or dd[2].dtype != du[2].dtype \
            or int(dd[2]) != int(du[2]):
        return None
    q = _q(g, g.sole_consumer(node.output[0]))
    if q is None:
        return None
    from .metadata import read_requantizer
    return ScatterAddCodes(g, node, dd, du, q, read_requantizer(g.model))
