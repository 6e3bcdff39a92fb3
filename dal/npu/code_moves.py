"""Requantized data movement as one table: DequantizeLinear -> moves -> QuantizeLinear -> DequantizeLinear.

A decoder's attention reads its KV cache as the cache quantizer's codes c, dequantized, moved
(grouped-query heads: Unsqueeze -> Expand -> Reshape, the keys also Transposed) and quantized
again by the attention product's input quantizer, then dequantized for the MatMul:

    y = DQ2(Q2(M(DQ1(c))))          M: Unsqueeze, Expand, Reshape, Transpose, Squeeze, Slice

(or, where Q2's codes are read as codes, e.g. the graph's ``present_*`` cache output sliced from
the dequantized cache and quantized again, ``q = Q2(M(DQ1(c))) = M(T[c])``, T[k] = Q2(DQ1(k))).
With scalar scales and zero points DQ1, Q2 and DQ2 are elementwise functions of one code, and M
only places, repeats or selects elements (Expand multiplies by ones: exact for the finite
dequantized values), so y = M(T[c]) with the 256-entry table T[k] = DQ2(Q2(DQ1(k))) computed at
load by the three steps themselves (the quantizer's C++ path and its node-by-node formula must
agree on the table, else nothing is fused). ``CodeMoves`` runs the moves on the cache's 1-byte
codes (ops_float's own functions; Expand as a broadcast view, the values ``codes * ones`` gives)
and one table lookup last, ``T[M(c)]``, instead of two quantizer passes on the expanded tensor; bit-identical to the steps one by one, which it runs when its input is not codes of the
expected type. Only a tensor read solely inside the pattern stays inside it (DQ1's output, read
by others too, stays its own step). Likewise the cache append ``Q(Concat(DQ1(c), x))`` runs as
``Concat(c, Q(x))`` where Q undoes DQ1 on all 256 codes (``CodeConcat``). A DQ1 no live step
reads any more is dropped from the run. ``dal.npu.load(..., fuse_chains=False)`` turns both off.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .byte_tables import ByteTable

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
        self.lookup = ByteTable(table).lookup  # C++ for large tensors (byte_tables.py)

    def run(self, ins, threads, want_extra=False):
        x = ins[0]
        if type(x) is np.ndarray and x.dtype == self.dtype:
            v = x.view(np.uint8)  # M(T[c]) = T[M(c)]: the moves on the 1-byte codes, one lookup last
            try:
                for fn, ctx, fixed, attrs in self.moves:
                    v = fn(ctx, [v] + fixed, attrs)[0]
            except Exception:  # e.g. shapes that do not broadcast: the steps name their node
                return self._one_by_one(ins, threads)
            return {self.outputs[0]: self.lookup(v)}
        return self._one_by_one(ins, threads)

    def _one_by_one(self, ins, threads):
        from .session import run_member
        first = [ins[0]] + [None if not i else self.consts[i] for i in self.first.inputs[1:]]
        env = {}
        for p, pins in [(self.first, first)] + [(p, None) for p in self.parts]:
            if pins is None:
                pins = [None if not i else env[i] if i in env else self.consts[i] for i in p.inputs]
            env.update(run_member(p, pins, threads))
        return {self.outputs[0]: env[self.outputs[0]]}


def _expand_view(ctx, ins, attrs):
    """ONNX Expand of codes as a broadcast view (no copy; the lookup after the moves copies):
    the values ops_float's ``x * ones(shape)`` gives, for integer codes exactly."""
    x, shape = ins[0], tuple(int(d) for d in np.asarray(ins[1]).reshape(-1))
    return [np.broadcast_to(x, np.broadcast_shapes(x.shape, shape))]


def _table(first, q2, dq2, consts):
    """T[k] = DQ2(Q2(DQ1(k))) (``dq2`` None: Q2(DQ1(k))) for the 256 codes k, or None when the
    quantizer's C++ path and its node-by-node formula disagree on it."""
    codes = np.arange(256, dtype=np.uint8).view(first.dtype)
    f = first.run([codes], 1)[first.outputs[0]]
    if not np.all(np.isfinite(f)):
        return None
    params = [None if not i else consts[i] for i in q2.inputs[1:]]
    fast = q2.run([f] + params, 1)[q2.outputs[0]]
    slow = q2.fallback.run([f] + params, 1)[q2.outputs[0]]
    if fast.dtype != slow.dtype or not np.array_equal(fast, slow):
        return None
    if dq2 is None:
        return np.ascontiguousarray(fast)
    if fast.dtype != dq2.dtype:
        return None
    return np.ascontiguousarray(dq2.run([fast], 1)[dq2.outputs[0]])


def fuse(steps, live, graph, consts, outputs, keep=frozenset()):
    """``steps`` with each live DQ1 -> moves -> Q2 [-> DQ2] pattern (module doc) after DQ1 replaced
    by one CodeMoves step placed where its last step was; DQ1 stays (a run drops it when no live
    step reads it any more). ``consts``: constant values (the moves' shape inputs); ``keep``:
    tensors none may touch (pixel-major ones)."""
    from .quant_step import DequantStep, QuantStep
    from .session import NodeStep

    readers = {}
    for k, (st, is_live) in enumerate(zip(steps, live)):
        for i in st.inputs:
            if i:
                readers.setdefault(i, []).append(k)
    outs, replaced, placed = set(outputs), set(), {}
    for k, st in enumerate(steps):
        if not (live[k] and type(st) is DequantStep) or st.outputs[0] in keep or k in replaced:
            continue  # (a DQ2 an earlier pattern took in: its input, Q2's codes, no longer exists)
        for r in readers.get(st.outputs[0], ()):
            found = _follow(steps, live, r, readers, outs, consts, keep, NodeStep, QuantStep, DequantStep)
            if found is None or any(m in replaced for m in found):
                continue
            parts = [steps[m] for m in found]
            ends_in_codes = type(parts[-1]) is QuantStep
            q2, dq2 = (parts[-1], None) if ends_in_codes else (parts[-2], parts[-1])
            table = _table(st, q2, dq2, consts)
            if table is None:
                continue
            moves = []
            for p in parts[:-1 if ends_in_codes else -2]:
                from .ops_float import OPS
                ctx = SimpleNamespace(node=p.node, opset=graph.opset, threads=1)
                fn = _expand_view if p.node.op_type == "Expand" else OPS[p.node.op_type]
                moves.append((fn, ctx, [None if not i else consts[i] for i in p.inputs[1:]], graph.attrs(p.node)))
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
    if q_out in keep:
        return None
    nxt = readers.get(q_out, [])
    if len(nxt) == 1 and q_out not in outs and type(steps[nxt[0]]) is DequantStep and live[nxt[0]]:
        return path + [r, nxt[0]]
    return path + [r]  # Q2's codes are read as codes (a graph output: the KV cache's present_*)


class CodeConcat:
    """``Q(Concat(DQ1(c), x, ...))`` as ``Concat(c, Q(x), ...)`` where Q(DQ1(k)) = k for all 256
    codes k (checked at load, both quantizer paths): a decoder appending the new token's keys or
    values to its dequantized cache and quantizing the whole cache again. Each input that is a
    dequantized code tensor of such a DQ1 is taken as its codes; every other input is quantized
    by Q's own step, then the pieces are concatenated: Q is elementwise, so this is Q on the
    concatenation, element for element. Inputs not of the expected types (codes of DQ1's type,
    float32 otherwise) run the Concat and Q steps one by one."""

    kind = "codes"
    nhwc_capable, nhwc_in, nhwc_out = None, (), False

    def __init__(self, concat, q, pieces, firsts, consts):
        self.concat, self.q, self.consts, self.firsts = concat, q, consts, firsts
        # per Concat input: ("codes", DQ1 dtype) read from DQ1's input, or ("float", None)
        self.pieces, self.axis = pieces, concat.g.attrs(concat.node).get("axis", 0)
        self.inputs = [firsts[k].inputs[0] if k in firsts else i for k, i in enumerate(concat.inputs)]
        self.outputs, self.extra_outputs = list(q.outputs), []
        self.node, self.node_name = q.node, q.node_name
        self.q_params = [None if not i else consts[i] for i in q.inputs[1:]]

    def run(self, ins, threads, want_extra=False):
        parts = []
        for (kind, dtype), x in zip(self.pieces, ins):
            if type(x) is not np.ndarray or x.dtype != (dtype if kind == "codes" else np.float32):
                return self._one_by_one(ins, threads)
            parts.append(x if kind == "codes" else self.q.run([x] + self.q_params, threads)[self.q.outputs[0]])
        return {self.outputs[0]: np.concatenate(parts, axis=self.axis)}

    def _one_by_one(self, ins, threads):
        """The Concat and Q steps one by one on the dequantized inputs (DQ1 recomputed from the codes)."""
        from .session import run_member
        vals = []
        for k, x in enumerate(ins):
            first = self.firsts.get(k)
            vals.append(x if first is None else first.run(
                [x] + [None if not i else self.consts[i] for i in first.inputs[1:]], threads)[first.outputs[0]])
        env = {}
        for p, pins in ((self.concat, vals), (self.q, None)):
            if pins is None:
                pins = [env[p.inputs[0]]] + self.q_params
            env.update(run_member(p, pins, threads))
        return {self.outputs[0]: env[self.outputs[0]]}


def fuse_concat(steps, live, consts, outputs, keep=frozenset()):
    """``steps`` with each live ``Concat -> Q`` whose Concat reads a DQ1 that Q undoes (module doc
    of CodeConcat) replaced by one CodeConcat step where Q was. The DQ1 steps stay (a run drops
    them when no live step reads them any more)."""
    from .quant_step import DequantStep, QuantStep
    from .session import NodeStep

    readers, producer = {}, {}
    for k, st in enumerate(steps):
        for i in st.inputs:
            if i:
                readers.setdefault(i, []).append(k)
        for o in st.outputs:
            producer[o] = k
    outs, replaced, placed = set(outputs), set(), {}
    for k, st in enumerate(steps):
        if not (live[k] and type(st) is NodeStep and st.node.op_type == "Concat") or len(st.outputs) != 1:
            continue
        out = st.outputs[0]
        rd = readers.get(out, [])
        if out in outs or out in keep or len(rd) != 1 or type(steps[rd[0]]) is not QuantStep or steps[rd[0]].nhwc_out:
            continue
        q = steps[rd[0]]
        pieces, firsts = [], {}
        for j, i in enumerate(st.inputs):
            p = producer.get(i)
            first = steps[p] if p is not None else None
            if (i and i not in keep and type(first) is DequantStep
                    and _undoes(q, first, consts)):
                pieces.append(("codes", first.dtype))
                firsts[j] = first
            else:
                pieces.append(("float", None))
        if not firsts or not all(i for i in st.inputs):
            continue
        replaced.update((k, rd[0]))
        placed[rd[0]] = CodeConcat(st, q, pieces, firsts, consts)
    return [placed[k] if k in placed else s for k, s in enumerate(steps) if k in placed or k not in replaced]


def _undoes(q, first, consts) -> bool:
    """Whether Q(DQ1(k)) = k for every code k of DQ1's type (both quantizer paths: :func:`_table`)."""
    codes = np.arange(256, dtype=np.uint8).view(first.dtype)
    table = _table(first, q, None, consts)
    return table is not None and table.dtype == codes.dtype and np.array_equal(table, codes)
