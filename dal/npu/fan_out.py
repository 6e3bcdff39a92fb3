"""A group read by several quantizers: one exact accumulator, requantized once per reader.

    DQ -> Conv/Gemm/MatMul [-> Add(bias)] [-> Relu/Clip] -> {Q_1, ..., Q_k}     (k >= 2)

Each reader r gets exactly what the group would compute were Q_r its only QuantizeLinear
(integer_groups.py, export/SPEC.md "integer groups"): ``q_r = requant_r(acc)`` with Q_r's own
scale, zero point and [lo, hi] (float requantizer or fixed-point multiplier and shift). The
accumulator does not depend on the reader. For a long reduction (K >= SHARE_MIN_K) the fused
kernel runs once (reader 1's codes come with it) and readers 2..k requantize its int32
accumulators (csrc requant kernels); for a short one, writing and re-reading the accumulators
costs more than the sums (bench/fan_out.py, bench/results/fan_out.md), so each reader runs
the fused kernel itself. Off the fused kernel (grouped / sparse weights,
accumulator models, intermediates asked for) every reader's step runs by itself too. Every
way computes the same codes (tests/npu/test_fan_out.py forces both).

Reader 1's output may be kept pixel-major (layout.py: output 0); the others are NCHW.
"""
from __future__ import annotations

import numpy as np

#: reduction length from which one accumulator pass + k - 1 requantizations beat k fused
#: kernel runs (module doc); below it every reader runs the fused kernel
SHARE_MIN_K = 1536


class FanOutStep:
    """k FusedSteps sharing one group (``steps[0]`` computes the accumulator)."""

    kind = "fused"

    def __init__(self, steps: list):
        self.steps = steps
        first = steps[0]
        self.node, self.node_name, self.op = first.node, first.node_name, first.op
        self.inputs = list(first.inputs)
        self.outputs = [s.q_out for s in steps]
        self.extra_outputs = list(first.extra_outputs)
        wf = first.w_fast
        self.k_red = int(np.prod(wf.shape[1:])) if wf is not None else 0

    def __getattr__(self, name):  # anything else (conv_w, fast, ...): the first reader's step
        if name == "steps":
            raise AttributeError(name)
        return getattr(self.steps[0], name)

    @property
    def nhwc_capable(self):
        return self.steps[0].nhwc_capable

    @property
    def nhwc_in(self):
        return self.steps[0].nhwc_in

    @nhwc_in.setter
    def nhwc_in(self, v):
        for s in self.steps:  # every reader reads the same input, in the same layout
            s.nhwc_in = v

    @property
    def nhwc_out(self):
        return self.steps[0].nhwc_out

    @nhwc_out.setter
    def nhwc_out(self, v):
        self.steps[0].nhwc_out = v
        for s in self.steps[1:]:
            s.nhwc_out = False

    def run(self, ins, threads, want_extra=False):
        first = self.steps[0]
        nin, nout = bool(first.nhwc_in and first.nhwc_in[0]), first.nhwc_out
        got = None
        if not want_extra and first.acc_model is None and self.k_red >= SHARE_MIN_K:
            try:
                got = first.rows_of(ins[0], threads, nin | nout << 1)
            except RuntimeError as e:  # the kernel's overflow flag: the per-reader path names it
                if "overflows int32" not in str(e):
                    raise  # anything else is a real failure, not a fallback
                got = None
        if got is None:
            out = {}
            for s in self.steps:
                out.update(s.run(ins, threads, want_extra and s is first))
            return out
        q, rows = got  # a Conv's codes_of_rows reads only the output shape, not ins[0]'s layout
        out = {first.q_out: q}
        for s in self.steps[1:]:
            out[s.q_out] = s.codes_of_rows(rows, first, ins[0], threads)
        return out
