"""An integer group followed by a MaxPool or a nearest Resize before its quantizer(s):

    DQ -> Conv/Gemm/MatMul [-> Add(bias)] [-> Relu/Clip] -> MaxPool | Resize(nearest) -> Q (or k Q)

runs as the group (requantized codes of the op's output, per reader), then the pool / resize
of the codes. Exact in the integer semantics: each reader's requantizer is non-decreasing in the
accumulator per channel (float: a positive multiplier, round, clamp; fixed point: m > 0, a
shift), so it commutes with a per-channel max, and a nearest Resize only picks elements
(export/SPEC.md §5a). The MaxPool windows all hold an element (group_chain.pass_through_ok):
padding never wins a max. 8-bit codes pool in csrc's code kernel with the identity table;
other widths, and the Resize, run the node-by-node kernels on the codes (exact: max and
gather).

``group_step`` builds the session's step for one matched group (a plan, or one per reader).
The session places such a step where the MaxPool / Resize node is, not where the Conv is: a
Resize's sizes may be computed (Shape of another tensor) after the Conv in the file's order, and
the Conv's own inputs are ready there too (its chain up to the pass-through has no other reader).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import quant
from .fan_out import FanOutStep

_8BIT = {np.dtype(np.int8), np.dtype(np.uint8)}


def group_step(g, node, plans: list, requantizer, threads):
    """FusedStep, FanOutStep (k readers) or PassThroughStep around either (module doc)."""
    from .integer_groups import FusedStep
    if plans[0].get("blocked"):  # blocked_groups.py
        from .blocked_groups import blocked_step
        return blocked_step(g, node, plans)
    post = plans[0].get("post")
    if post is not None:  # the group writes internal names, the pass-through the readers'
        plans = [dict(p, q_out=p["q_out"] + "\x00pre") for p in plans]
    fused = [FusedStep(g, node, p, requantizer, threads) for p in plans]
    step = fused[0] if len(fused) == 1 else FanOutStep(fused)
    return step if post is None else PassThroughStep(g, step, post, [p["q_out"] for p in plans])


class PassThroughStep:
    """``inner`` (a group step writing ``pre`` names), then ``post`` on each reader's codes."""

    kind = "fused"
    nhwc_capable, nhwc_in, nhwc_out = False, (), False  # layout.py: NCHW in and out

    def __init__(self, g, inner, post, pre: list):
        self.g, self.inner, self.post = g, inner, post
        self.node, self.node_name, self.op = inner.node, inner.node_name, inner.op
        # the Resize's roi / scales / sizes are inputs of the step (constants or run-time values)
        self.n_inner = len(inner.inputs)
        self.inputs = list(inner.inputs) + list(post.input[1:])
        self.pre = pre
        self.outputs = [p[:-len("\x00pre")] for p in pre]
        self.extra_outputs = list(inner.extra_outputs) + [post.output[0]]
        self.attrs = g.attrs(post)
        self._ident = {}

    def __getattr__(self, name):  # anything else (conv_w, fast, ...): the group's step
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _ctx(self, threads):
        return SimpleNamespace(node=self.post, opset=self.g.opset, threads=threads)

    def _apply(self, x, post_ins, threads):
        """The MaxPool / Resize of codes (or of a float value, for the intermediates)."""
        from .ops_float import OPS
        from .validate import precheck
        if self.post.op_type == "MaxPool" and x.dtype in _8BIT and x.ndim == 4:
            y = self._pool8(x, threads)
            if y is not None:
                return y
        ins = [x] + list(post_ins)
        precheck(self.post, ins, self.attrs)
        return OPS[self.post.op_type](self._ctx(threads), ins, self.attrs)[0]

    def _pool8(self, x, threads):
        import torch
        from .build import kernels as lib
        from .ops_nn import pool_attrs
        ks, st, dil, pads, _ = pool_attrs(self._ctx(threads), x, self.attrs)
        n, c, h, w = x.shape
        oh = (h + pads[0] + pads[2] - ks[0]) // st[0] + 1
        ow = (w + pads[1] + pads[3] - ks[1]) // st[1] + 1
        if oh < 1 or ow < 1:
            return None
        if x.dtype not in self._ident:
            lo, hi = quant.int_range(x.dtype)
            self._ident[x.dtype] = (torch.from_numpy(np.arange(lo, hi + 1).astype(x.dtype)), lo)
        lut, base = self._ident[x.dtype]
        xt = torch.from_numpy(np.ascontiguousarray(x))
        ys = [lib().maxpool_codes(xt[b], ks[0], ks[1], st[0], st[1], 1, 1, pads[0], pads[1], oh, ow,
                                  lut, base, threads) for b in range(n)]
        return np.stack([y.numpy() for y in ys]).reshape(n, c, oh, ow)

    def run(self, ins, threads, want_extra=False):
        got = self.inner.run(ins[:self.n_inner], threads, want_extra)
        rest = ins[self.n_inner:]
        out = {k: v for k, v in got.items() if k not in self.pre}
        for pre, name in zip(self.pre, self.outputs):
            out[name] = self._apply(got[pre], rest, threads)
        if want_extra:  # the float value the pass-through node holds in the graph
            last = [o for o in self.inner.extra_outputs if o in got][-1]
            out[self.post.output[0]] = self._apply(got[last], rest, threads)
        return out
