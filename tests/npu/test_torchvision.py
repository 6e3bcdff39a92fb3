"""quantize_static QDQ exports of torchvision CNNs (random weights): the NPU reference vs
onnxruntime (ORT_DISABLE_ALL) and onnx.reference on every QuantizeLinear output.

Measured (1x3x64x64, see README): "onnx" semantics equals onnxruntime on 100% of Q elements
end to end and layer by layer, and onnx.reference layer by layer; "integer" semantics differs
on 0-2 elements per model by 1 LSB (float32 near-ties of the graph's own conv). onnx.reference itself disagrees with onnxruntime end to end on resnet18 (one
element flips by 1 LSB in layer1 -- a float32 near-tie of its Conv -- and cascades), so the
comparison with it is made layer by layer: each step fed the oracle's own inputs.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import oracles
import zoo

MODELS = [("resnet18", "u8", True), ("resnet18", "s8", True), ("resnet18", "u8", False),
          ("mobilenet_v2", "u8", True), ("mobilenet_v2", "s8", False)]


def _run(arch, act, pc, model_dir, hw=64):
    import dal.npu as npu
    m = onnx.load(zoo.torchvision_qdq(arch, model_dir, hw=hw, activation=act, per_channel=pc))
    x = np.random.default_rng(1).standard_normal((1, 3, hw, hw)).astype(np.float32)
    feed = {"input": x}
    ov, rv = oracles.ort_values(m, feed), oracles.ref_values(m, feed)
    qn = oracles.q_names(m)
    out = {}
    for sem in ("integer", "onnx"):
        s = npu.load(m, semantics=sem)
        vals = s.run(feed, return_intermediates=True)[1]
        out[sem] = {
            "e2e_ort": oracles.compare_codes(vals, ov, qn),
            "layer_ort": oracles.compare_codes(s.run_layerwise({**ov, **feed}), ov, qn),
            "layer_ref": oracles.compare_codes(s.run_layerwise({**rv, **feed}), rv, qn),
        }
    return out


@pytest.mark.parametrize("arch,act,pc", MODELS)
def test_torchvision_parity(arch, act, pc, model_dir, npu_lib):
    res = _run(arch, act, pc, model_dir)
    print(arch, act, pc, res)
    _assert_layerwise(res)
    # end to end a single near-tie can cascade (the oracles themselves disagree end to end on
    # resnet18); measured at 64x64: 0 or 1 element, 1 LSB
    for sem in ("integer", "onnx"):
        assert res[sem]["e2e_ort"]["differ"] <= 1e-5 * res[sem]["e2e_ort"]["elements"], res[sem]


def _assert_layerwise(res):
    # "onnx" semantics reproduces the float32 graph: identical to both oracles, every layer
    for k in ("layer_ort", "layer_ref"):
        assert res["onnx"][k]["differ"] == 0, (k, res["onnx"])
    # "integer" semantics (exact int32 + one rounding) differs from the float32 graph only at
    # near-ties: measured 0-2 elements of ~3e5-6e5, 1 LSB
    for k in ("layer_ort", "layer_ref"):
        r = res["integer"][k]
        assert r["max_lsb"] <= 1 and r["differ"] <= 1e-5 * r["elements"], (k, r)


@pytest.mark.slow
def test_resnet18_224(model_dir, npu_lib):
    res = _run("resnet18", "u8", True, model_dir, hw=224)
    print(res)
    _assert_layerwise(res)  # end to end, near-ties cascade at 224 (measured ~4% of codes, <= 7 LSB)
