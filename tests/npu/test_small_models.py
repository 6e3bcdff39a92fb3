"""Small helper-built QDQ graphs: NPU reference == onnx.reference == onnxruntime
(ORT_DISABLE_ALL) on every QuantizeLinear output, end to end, in both semantics."""
from __future__ import annotations


import numpy as np
import pytest

import graphs
import oracles
from dal.npu.compare import compare_values, summarize  # checked against oracles.compare_codes in _check

CONV = [dict(act=a, wtype=w, per_channel=pc, group=g, stride=s, dilation=d, pads=p, relu=r, clip=c)
        for a, w, pc, g, s, d, p, r, c in [
            ("u8", "s8", True, 1, (1, 1), (1, 1), (1, 1, 1, 1), True, False),
            ("s8", "s8", False, 1, (2, 2), (1, 1), (0, 1, 2, 0), False, False),
            ("u8", "u8", True, 2, (1, 2), (2, 1), (2, 2, 2, 2), True, False),
            ("u8", "s8", True, 8, (1, 1), (1, 1), (1, 1, 1, 1), True, False),   # depthwise
            ("s8", "s4", True, 1, (1, 1), (1, 1), (1, 0, 1, 0), False, True),
            ("u8", "u4", False, 4, (2, 1), (1, 2), (1, 1, 1, 1), True, False),
        ]]


def _check(model, x, semantics, both=True):
    import dal.npu as npu
    feed = {"x": x}
    vals = npu.load(model, semantics=semantics).run(feed, return_intermediates=True)[1]
    qn = oracles.q_names(model)
    theirs = {"ort": oracles.ort_values(model, feed)}
    if both:
        theirs["ref"] = oracles.ref_values(model, feed)
    res = {who: oracles.compare_codes(vals, ov, qn) for who, ov in theirs.items()}
    for who, ov in theirs.items():  # dal's own counting agrees with the oracle's
        assert summarize(compare_values(vals, ov, qn)) == res[who], who
    return res


@pytest.mark.parametrize("semantics", ["integer", "onnx"])
@pytest.mark.parametrize("i", range(len(CONV)))
def test_conv(i, semantics, npu_lib):
    m = graphs.conv_model(seed=i, **CONV[i])
    x = np.random.default_rng(i).standard_normal((1, 8, 12, 12)).astype(np.float32)
    for who, r in _check(m, x, semantics).items():
        assert r["differ"] == 0, (who, r)


@pytest.mark.parametrize("semantics", ["integer", "onnx"])
@pytest.mark.parametrize("op,wtype,pc,block,act", [
    ("Gemm", "s8", True, 0, "u8"), ("Gemm", "u8", False, 0, "s8"), ("MatMul", "s8", True, 0, "s8"),
    ("MatMul", "s4", True, 0, "u8"), ("MatMul", "s4", False, 8, "u8"), ("MatMul", "u4", False, 16, "s8")])
def test_linear(op, wtype, pc, block, act, semantics, npu_lib):
    m = graphs.linear_model(seed=3, act=act, wtype=wtype, per_channel=pc, op=op, block=block)
    x = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
    for who, r in _check(m, x, semantics).items():
        assert r["differ"] == 0, (who, r)


@pytest.mark.parametrize("semantics", ["integer", "onnx"])
@pytest.mark.parametrize("act", ["u8", "s8"])
def test_mixed_graph(act, semantics, npu_lib):
    m = graphs.mixed_model(seed=1, act=act)
    x = np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32)
    for who, r in _check(m, x, semantics).items():
        assert r["differ"] == 0, (who, r)


def test_fused_groups_are_used(npu_lib):
    import dal.npu as npu
    s = npu.load(graphs.mixed_model(seed=1))
    assert sum(st.kind == "fused" for st in s.steps) == 3  # the Gemm reads a Flatten, not a DQ
