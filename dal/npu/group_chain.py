"""The output side of an integer group: what may sit between its Conv / Gemm / MatMul and the
QuantizeLinear that ends it (integer_groups.py).

    op -> [Add(DQ(b_q int32, s_x * s_w, 0))] -> [Relu | Clip(lo, hi)] -> QuantizeLinear(s_y, zp_y)

The bracketed Add is the bias of a Linear on rank > 2 inputs, which torch writes as
``MatMul(x, W)`` then ``Add`` (export/SPEC.md §4): it is taken into the group only for a MatMul
with no bias of its own, when the other Add input is a DequantizeLinear of 1-D int32 codes (one
per output channel) with zero point 0 and scale exactly ``float32(s_x) * float32(s_w[c])``. Then
``b_q`` is added to the exact accumulator as a Gemm's input-2 bias is, so the two spellings of a
Linear compute the same codes. Any other Add (a float bias, another scale, a broadcast bias, a
MatMul output read elsewhere) leaves the MatMul a float island, as before.

The session absorbs the consumers of ``op_out`` and ``act_out`` into the group. With an Add and
no Relu / Clip, ``act_out`` is the Add's output (no bounds); with both, ``act_out`` is the
activation's output and the Add's output is ``add_out``, an extra output the step also fills
when intermediates are asked for: the activation node is then not absorbed but dead (its only
reader, the QuantizeLinear, is inside the group), and recomputes the same value when run.
"""
from __future__ import annotations

import numpy as np

from . import quant

OUT_CODES = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16)} | quant.INT4


def is_dq(n) -> bool:
    return n is not None and n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx") and len(n.input) >= 2


def bias_add(g, node, plan):
    """(Add node, int64 bias codes) when ``node`` (a bias-less MatMul) is read only by an Add of
    the int32 bias of the module doc; else (None, None)."""
    if node.op_type != "MatMul" or plan.get("bias_q") is not None or plan.get("bias_f") is not None:
        return None, None
    add = g.sole_consumer(node.output[0])
    if add is None or add.op_type != "Add" or len(add.input) != 2 or add.domain not in ("", "ai.onnx"):
        return None, None
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    if other == node.output[0]:
        return None, None
    dqb = g.producer(other)
    if not is_dq(dqb) or g.attrs(dqb).get("block_size", 0):
        return None, None
    bq, bs, bz = g.const(dqb.input[0]), g.const(dqb.input[1]), g.const_opt(dqb, 2)
    c = plan["channels"]
    if bq is None or bs is None or bq.dtype != np.int32 or bq.ndim != 1 or bq.size != c:
        return None, None
    if bz is not None and (bz.dtype != np.int32 or np.any(bz != 0)) or bs.dtype != np.float32:
        return None, None
    want = (np.float32(plan["x_scale"]) * plan["w_scale"].astype(np.float32)).astype(np.float32)
    if bs.size not in (1, c) or not np.array_equal(np.broadcast_to(bs.reshape(-1), (c,)), np.broadcast_to(want, (c,))):
        return None, None
    return add, bq.astype(np.int64)


def plan_output_chain(g, node, plan) -> bool:
    """The chain [Add(bias)] [Relu | Clip] -> QuantizeLinear into ``plan``; False if there is
    none. Sets op_out, act_out, act_lo, act_hi, add_out, bias_add and the output quantizer's q_out,
    q_node, y_scale, y_zp, y_dtype (and bias_q when the Add is taken in)."""
    out = node.output[0]
    plan["op_out"], plan["act_out"], plan["act_lo"], plan["act_hi"], plan["add_out"] = out, None, None, None, None
    plan["bias_add"] = False
    add, bq = bias_add(g, node, plan)
    if add is not None:
        out = add.output[0]
    nxt = g.sole_consumer(out)
    if nxt is not None and nxt.op_type in ("Relu", "Clip"):
        if nxt.op_type == "Relu":
            plan["act_lo"] = 0.0
        else:
            lo, hi = g.clip_bounds(nxt)
            if lo is False:
                return False
            plan["act_lo"], plan["act_hi"] = lo, hi
        plan["act_out"] = nxt.output[0]
        nxt = g.sole_consumer(nxt.output[0])
    if nxt is None or nxt.op_type != "QuantizeLinear":
        return False
    ys, yz = g.const(nxt.input[1]), g.const_opt(nxt, 2)
    if ys is None or yz is None or ys.size != 1 or yz.size != 1 or ys.dtype != np.float32 or yz.dtype not in OUT_CODES:
        return False
    if g.attrs(nxt).get("block_size", 0):
        return False
    plan["bias_add"] = add is not None
    if add is not None:
        plan["bias_q"] = bq
        if plan["act_out"] is None:
            plan["act_out"] = add.output[0]  # absorbs the QuantizeLinear (module doc)
        else:
            plan["add_out"] = add.output[0]
    plan.update(q_out=nxt.output[0], q_node=nxt, y_scale=np.float32(ys.reshape(())),
                y_zp=int(yz.reshape(-1)[0]), y_dtype=yz.dtype)
    return True
