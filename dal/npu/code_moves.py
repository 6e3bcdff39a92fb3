"""Requantized data movement as one table: DequantizeLinear -> moves -> QuantizeLinear -> DequantizeLinear.

A decoder's attention reads its KV cache as the cache quantizer's codes c, dequantized, moved
(grouped-query heads: Unsqueeze -> Expand -> Reshape, the keys also Transposed) and quantized
again by the attention product's input quantizer, then dequantized for the MatMul:

    y = DQ2(Q2(M(DQ1(c))))          M: Unsqueeze, Expand, Reshape, Transpose, Squeeze, Slice

With scalar scales and zero points DQ1, Q2 and DQ2 are elementwise functions of one code, and M
only places, repeats or selects elements (Expand multiplies by ones: exact for the finite
dequantized values), so y = M(T[c]) with the 256-entry table T[k] = DQ2(Q2(DQ1(k))) computed at
load by the three steps themselves (the quantizer's C++ path and its node-by-node formula must
agree on the table, else nothing is fused). ``CodeMoves`` runs one table lookup on the cache's
codes and the moves (ops_float's own functions), instead of two quantizer passes on the expanded
tensor; bit-identical to the steps one by one, which it runs when its input is not codes of the
expected type. Only a tensor read solely inside the pattern stays inside it (DQ1's output, read
by others too, stays its own step). ``dal.npu.load(..., fuse_chains=False)`` turns it off.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

#: the data movement ops a pattern's M may hold (each with constant non-data inputs)
MOVES = frozenset({"Unsqueeze", "Expand", "Reshape", "Transpose", "Squeeze", "Slice"})


class CodeMoves:
    """``DQ2(Q2(M(DQ1(c))))`` as ``M(T[c])`` (module doc). ``parts``: the replaced steps (the moves,
    Q2, DQ2); ``first``: the DQ1 step (not replaced: it stays for its other readers)."""

    kind = "codes"
    nhwc_capable, nhwc_in, nhwc_out = None, (), False

    def __init__(self, first, moves, table, parts, consts):
        self.first, self.moves, self.table, self.parts, self.consts = first, moves, table, parts, consts
        self.inputs, self.outputs, self.extra_outputs = [first.inputs[0]], list(parts[-1].outputs), []
        self.node, self.node_name = parts[-1].node, parts[-1].node_name
        self.dtype = first.dtype

    def run(self, ins, threads, want_extra=False):
        x = ins[0]
        if type(x) is np.ndarray and x.dtype == self.dtype:
            v = np.take(self.table, x.view(np.uint8))
            for fn, ctx, fixed, attrs in self.moves:
                v = fn(ctx, [v] + fixed, attrs)[0]
            return {self.outputs[0]: v}
        return self._one_by_one(ins, threads)

    def _one_by_one(self, ins, threads):
        from .errors import NPUError
        from .session import named
        first = [ins[0]] + [None if not i else self.consts[i] for i in self.first.inputs[1:]]
        env = {}
        for p, pins in [(self.first, first)] + [(p, None) for p in self.parts]:
            if pins is None:
                pins = [None if not i else env[i] if i in env else self.consts[i] for i in p.inputs]
            try:
                env.update(p.run(pins, threads))
            except NPUError as e:
                e.node_named = True
                raise named(e, p.node)
        return {self.outputs[0]: env[self.outputs[0]]}


def _table(first, q2, dq2, consts):
    """T[k] = DQ2(Q2(DQ1(k))) for the 256 codes k, or None when the quantizer's C++ path and its
    node-by-node formula disagree on it."""
    codes = np.arange(256, dtype=np.uint8).view(first.dtype)
    f = first.run([codes], 1)[first.outputs[0]]
    if not np.all(np.isfinite(f)):
        return None
    params = [None if not i else consts[i] for i in q2.inputs[1:]]
    fast = q2.run([f] + params, 1)[q2.outputs[0]]
    slow = q2.fallback.run([f] + params, 1)[q2.outputs[0]]
    if fast.dtype != slow.dtype or not np.array_equal(fast, slow) or fast.dtype != dq2.dtype:
        return None
    return np.ascontiguousarray(dq2.run([fast], 1)[dq2.outputs[0]])


def fuse(steps, live, graph, consts, outputs, keep=frozenset()):
    """``steps`` with each live DQ1 -> moves -> Q2 -> DQ2 pattern (module doc) after DQ1 replaced
    by one CodeMoves step placed where DQ2 was; DQ1 stays. ``consts``: constant values (the
    moves' shape inputs); ``keep``: tensors none may touch (pixel-major ones)."""
    from .quant_step import DequantStep, QuantStep
    from .session import NodeStep

    readers = {}
    for k, (st, is_live) in enumerate(zip(steps, live)):
        for i in st.inputs:
            if i:
                readers.setdefault(i, []).append(k)
    outs, replaced, placed = set(outputs), set(), {}
    for k, st in enumerate(steps):
        if not (live[k] and type(st) is DequantStep) or st.outputs[0] in keep:
            continue
        for r in readers.get(st.outputs[0], ()):
            found = _follow(steps, live, r, readers, outs, consts, keep, NodeStep, QuantStep, DequantStep)
            if found is None or any(m in replaced for m in found):
                continue
            parts = [steps[m] for m in found]
            q2, dq2 = parts[-2], parts[-1]
            table = _table(st, q2, dq2, consts)
            if table is None:
                continue
            moves = []
            for p in parts[:-2]:
                from .ops_float import OPS
                ctx = SimpleNamespace(node=p.node, opset=graph.opset, threads=1)
                moves.append((OPS[p.node.op_type], ctx, [None if not i else consts[i] for i in p.inputs[1:]],
                              graph.attrs(p.node)))
            replaced.update(found)
            placed[found[-1]] = CodeMoves(st, moves, table, parts, consts)
    return [placed[k] if k in placed else s for k, s in enumerate(steps) if k in placed or k not in replaced]


def _follow(steps, live, r, readers, outs, consts, keep, NodeStep, QuantStep, DequantStep):
    """Indices of moves..., Q2, DQ2 starting at step ``r`` (a reader of DQ1's output), or None."""
    path = []
    while True:
        st = steps[r]
        if not live[r]:
            return None
        if type(st) is QuantStep:
            break
        if type(st) is not NodeStep or st.node.op_type not in MOVES or len(st.outputs) != 1:
            return None
        if any(i and i not in consts for i in st.inputs[1:]):
            return None
        path.append(r)
        nxt = readers.get(st.outputs[0], [])
        if len(nxt) != 1 or st.outputs[0] in outs or st.outputs[0] in keep:
            return None
        r = nxt[0]
    if not path or st.nhwc_out:
        return None
    q_out = st.outputs[0]
    nxt = readers.get(q_out, [])
    if len(nxt) != 1 or q_out in outs or q_out in keep or type(steps[nxt[0]]) is not DequantStep:
        return None
    return path + [r, nxt[0]]
