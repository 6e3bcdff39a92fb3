"""Fixed-point requantizer (dal.requantizer metadata) vs an independent Python-int model."""
from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import onnx
import pytest

import graphs
from oracles import ort_values


def _model_m_n(mult: float, bits: int):
    """Independent derivation: smallest n with 2^(bits-1) <= M * 2^n < 2^bits, m = round(M*2^n)."""
    fm = Fraction(mult)
    n = 0
    while fm * 2**n >= 2**bits:
        n -= 1
    while fm * 2**n < 2**(bits - 1):
        n += 1
    m = round(fm * 2**n)  # Fraction rounds half to even
    if m == 2**bits:
        m, n = m // 2, n - 1
    return m, n


def _round_shift(p: int, n: int, mode: str) -> int:
    if n <= 0:
        return p * 2**(-n)
    q = Fraction(p, 2**n)
    fl = math.floor(q)
    frac = q - fl
    if frac > Fraction(1, 2):
        return fl + 1
    if frac < Fraction(1, 2):
        return fl
    return {"half_up": fl + 1, "half_even": fl + (fl & 1), "half_away": fl + 1 if p > 0 else fl}[mode]


@pytest.mark.parametrize("mode", ["half_up", "half_even", "half_away"])
@pytest.mark.parametrize("bits", [31, 15, 8])
def test_conv_fixed_point(mode, bits, npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=5, act="s8", wtype="s8", per_channel=True, relu=False, bias=True)
    m.metadata_props.append(onnx.StringStringEntryProto(key="dal.requantizer", value=json.dumps(
        {"kind": "fixed_point", "multiplier_bits": bits, "rounding": mode})))
    x = np.random.default_rng(0).standard_normal((1, 8, 12, 12)).astype(np.float32)
    # independent model: exact integer accumulators from the onnx graph's own tensors, the input
    # codes and the float-requantizer output taken from onnxruntime (ORT_DISABLE_ALL), not dal
    vals = ort_values(m, {"x": x})
    g = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    nodes = {n.op_type: n for n in m.graph.node}
    conv = nodes["Conv"]
    dqs = {n.output[0]: n for n in m.graph.node if n.op_type == "DequantizeLinear"}
    dqx, dqw, dqb = (dqs[i] for i in conv.input)
    xq = vals[dqx.input[0]].astype(np.int64) - int(g[dqx.input[2]])
    wq = g[dqw.input[0]].astype(np.int64)
    acc = np.zeros((16, 12, 12), dtype=np.int64)
    xp = np.pad(xq[0], ((0, 0), (1, 1), (1, 1)))
    for i in range(3):
        for j in range(3):
            acc += np.einsum("oc,chw->ohw", wq[:, :, i, j], xp[:, i:i + 12, j:j + 12])
    acc += g[dqb.input[0]].reshape(-1, 1, 1)
    q = [n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == conv.output[0]][0]
    sy, zy = np.float32(g[q.input[1]]), int(g[q.input[2]])
    sx, sw = np.float32(g[dqx.input[1]]), g[dqw.input[1]]
    want = np.empty_like(acc)
    for o in range(16):
        mm, nn = _model_m_n(float(np.float64(sx) * np.float64(sw[o]) / np.float64(sy)), bits)
        for idx, a in np.ndenumerate(acc[o]):
            want[(o,) + idx] = min(127, max(-128, _round_shift(int(a) * mm, nn, mode) + zy))
    got = npu.load(m).run({"x": x}, return_intermediates=True)[1][q.output[0]]
    assert np.array_equal(got[0].astype(np.int64), want)
    # within 1 LSB of the float graph (ONNX semantics, onnxruntime) for 31 bits
    if bits == 31:
        assert got.shape == vals[q.output[0]].shape
        assert np.abs(got.astype(int) - vals[q.output[0]].astype(int)).max() <= 1


def test_fixed_point_params_match_independent_model():
    from dal.npu.metadata import fixed_point_params
    rng = np.random.default_rng(0)
    for mult in list(rng.uniform(1e-6, 4, 500)) + [1.0, 0.5, 2.0**-20, 1 - 2**-40]:
        for bits in (31, 16, 8):
            assert fixed_point_params(float(mult), bits) == _model_m_n(float(mult), bits)


def test_bad_requantizer_metadata():
    import dal.npu as npu
    m = graphs.conv_model(seed=1)
    m.metadata_props.append(onnx.StringStringEntryProto(key="dal.requantizer", value='{"kind": "magic"}'))
    with pytest.raises(npu.NPUError, match="kind"):
        npu.load(m)
