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

A MaxPool or nearest Resize may follow (``pass_through_ok``): the group then requantizes, and
pools / resizes the codes, which is the same because the requantizer is non-decreasing per
channel and max / nearest pick elements (group_post.py). The chain's last tensor may be read by k >= 2 QuantizeLinear nodes and nothing else
(``fan_out_readers``): the plan then lists them all in ``q_readers`` and ``for_reader`` gives
one plan per reader, the same accumulator through that reader's own requantizer (fan_out.py).
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
    """The chain [Add(bias)] [Relu | Clip] [MaxPool | Resize] -> QuantizeLinear into ``plan``;
    False if there is none. Sets op_out, act_out, act_lo, act_hi, add_out, bias_add, post and
    post_out (the pass-through node and its output, or None) and the output quantizer's q_out,
    q_node, y_scale, y_zp, y_dtype (and bias_q when the Add is taken in) of the first reader, and
    q_readers: every QuantizeLinear reading the chain's end (one, or k >= 2 quantizers and
    nothing else: fan_out_readers; for_reader gives the plan of each)."""
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
        out = plan["act_out"]
    plan["post"] = plan["post_out"] = None
    # MaxPool / nearest Resize of a Conv's codes (channels on axis 1, never pooled together)
    if (nxt is not None and node.op_type == "Conv" and nxt.input[0] == out and out not in nxt.input[1:]
            and pass_through_ok(g, nxt)):
        plan["post"], plan["post_out"] = nxt, nxt.output[0]
        out = nxt.output[0]
        nxt = g.sole_consumer(out)
    readers = [nxt] if nxt is not None else fan_out_readers(g, out)
    if not readers or not all(_q_ok(g, r) for r in readers):
        return False
    nxt = readers[0]
    ys, yz = g.const(nxt.input[1]), g.const_opt(nxt, 2)
    plan["bias_add"] = add is not None
    if add is not None:
        plan["bias_q"] = bq
        if plan["act_out"] is None:
            plan["act_out"] = add.output[0]  # absorbs the QuantizeLinear (module doc)
        else:
            plan["add_out"] = add.output[0]
    plan.update(q_out=nxt.output[0], q_node=nxt, y_scale=np.float32(ys.reshape(())),
                y_zp=int(yz.reshape(-1)[0]), y_dtype=yz.dtype, q_readers=readers)
    return True


def fan_out_readers(g, name) -> list:
    """The k >= 2 readers of ``name`` when every one is a QuantizeLinear and ``name`` is no graph
    output (export/SPEC.md: a group read by several quantizers requantizes its exact
    accumulator once per reader); else []."""
    rs = g.consumers(name)
    if len(rs) < 2 or name in g.outputs or any(r.op_type != "QuantizeLinear" for r in rs):
        return []
    if len({id(r) for r in rs}) != len(rs):  # one node reading the tensor twice
        return []
    return list(rs)


def pass_through_ok(g, n) -> bool:
    """``n`` picks elements of its input without arithmetic, so it commutes with the group's
    requantizer (non-decreasing per channel): a 2-D MaxPool (no Indices, dilation 1, no ceil
    mode, every window holding an element: pads < kernel), or a nearest Resize (opset >= 11,
    not tf_crop_and_resize, keep_aspect_ratio_policy stretch; its scales / sizes may be computed
    at run time, e.g. from another tensor's Shape)."""
    if n.domain not in ("", "ai.onnx") or len(n.output) != 1:
        return False
    a = g.attrs(n)
    if n.op_type == "MaxPool":
        ks = list(a.get("kernel_shape") or [])
        pads = list(a.get("pads") or [0] * 4)
        ap = a.get("auto_pad", "NOTSET")
        return (len(ks) == 2 and len(pads) == 4 and not a.get("ceil_mode", 0) and ap in ("NOTSET", b"NOTSET")
                and all(d == 1 for d in (a.get("dilations") or [1, 1]))
                and all(0 <= p < k for p, k in zip(pads, ks + ks)) and a.get("storage_order", 0) == 0)
    if n.op_type == "Resize":
        mode = a.get("mode", "nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        ctm = a.get("coordinate_transformation_mode", "half_pixel")
        ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
        kar = a.get("keep_aspect_ratio_policy", "stretch")
        kar = kar.decode() if isinstance(kar, bytes) else kar
        # tf_crop_and_resize writes extrapolation_value (a float, not a code) outside the crop
        return (mode == "nearest" and ctm != "tf_crop_and_resize" and kar == "stretch" and not a.get("axes")
                and g.opset >= 11 and len(n.input) >= 2)
    return False


def _q_ok(g, n) -> bool:
    """A QuantizeLinear with scalar float32 scale and a scalar 16/8/4-bit zero point, unblocked."""
    if n is None or n.op_type != "QuantizeLinear" or n.domain not in ("", "ai.onnx"):
        return False
    ys, yz = g.const(n.input[1]), g.const_opt(n, 2)
    if ys is None or yz is None or ys.size != 1 or yz.size != 1 or ys.dtype != np.float32 or yz.dtype not in OUT_CODES:
        return False
    return not g.attrs(n).get("block_size", 0)


def for_reader(g, plan: dict, q) -> dict:
    """``plan`` (a group read by several quantizers) for its reader ``q``, as if ``q`` were the
    group's only QuantizeLinear: the same weights and accumulator, q's own scale and zero point."""
    ys, yz = g.const(q.input[1]), g.const_opt(q, 2)
    one = dict(plan)
    one.update(q_out=q.output[0], q_node=q, y_scale=np.float32(ys.reshape(())),
               y_zp=int(yz.reshape(-1)[0]), y_dtype=yz.dtype, q_readers=[q])
    return one
