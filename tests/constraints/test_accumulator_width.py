"""Accumulator width: prepare (and export) warn, naming the layer, when the worst case can pass
``accumulator_bits``; dal.npu saturates (or wraps) exactly as the float64 model of the rule."""
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import dal
from constraints_common import export, ort_all, pow2_hw, set_meta
from ref64 import run_group


class Wide(nn.Module):
    """A short conv (27 terms) and a long one (256 * 9 = 2304 terms)."""

    def __init__(self):
        super().__init__()
        self.short = nn.Conv2d(3, 256, 3, padding=1)
        self.long = nn.Conv2d(256, 8, 3, padding=1)

    def forward(self, x):
        return self.long(torch.relu(self.short(x)))


def _prepared(bits=24, overflow="saturate"):
    torch.manual_seed(0)
    net = Wide()
    with torch.no_grad():  # positive weights and inputs: the long sums really grow
        net.long.weight.uniform_(0.5, 1.0)
        net.short.weight.abs_()
        net.short.bias.fill_(0.1)
    x = torch.rand(1, 3, 6, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = dal.prepare_qat(net, recipe="pow2_int8", hardware=pow2_hw(name="pow2_int8_acc24", accumulator_bits=bits,
                                                                       accumulator_overflow=overflow),
                            example_inputs=(x,), quantize_outputs=True)
    return m, x, [str(w.message) for w in caught if "accumulator" in str(w.message)]


def test_a_long_int8_reduction_is_named_for_a_24_bit_accumulator():
    m, _, messages = _prepared()
    assert len(messages) == 1, messages
    assert messages[0].startswith("accumulator overflow possible: long (QConv2d): worst-case accumulation")
    assert "over 2304 terms exceeds the 24-bit accumulator of 'pow2_int8_acc24' (max 8388607)" in messages[0]
    assert any(n.startswith("accumulator: long") for n in dal.prepared(m).report.notes)
    _, _, wide = _prepared(bits=32)
    assert wide == []  # 255 * 127 * 2304 < 2^31


@pytest.mark.parametrize("overflow", ["saturate", "wrap"])
def test_npu_accumulator_matches_the_float64_rule(tmp_path, overflow, npu_lib):
    import dal.npu
    m, x, _ = _prepared(overflow=overflow)
    calib = [(torch.rand(1, 3, 6, 6),) for _ in range(2)]
    dal.calibrate(m, calib, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = export(m, x, tmp_path / "acc.onnx")
    assert any("long (QConv2d)" in str(w.message) for w in caught)  # at export too, from the trained codes
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["dal.accumulator"] == f'{{"bits": 24, "overflow": "{overflow}"}}'
    feed = {"input": np.random.default_rng(0).random((1, 3, 6, 6)).astype(np.float32)}
    ref = ort_all(model, feed)
    sess = dal.npu.load(model)
    got = sess.run_layerwise(ref)
    step = next(s for s in sess.steps if getattr(s, "node_name", "") == "/long/Conv")
    assert step.acc_model is not None
    want, acc = run_group(model, step.node_name, ref[step.inputs[0]], "power_of_two", "half_even", 24, overflow)
    exact, _ = run_group(model, step.node_name, ref[step.inputs[0]], "power_of_two", "half_even")
    assert np.abs(acc).max() > 2 ** 23  # the accumulator really overflowed ...
    assert (want != exact).any()  # ... and that changed codes
    assert np.array_equal(got[step.outputs[0]], want)
    # without the declaration the same file runs with the exact int32 accumulator
    exact_model = set_meta(model, "dal.accumulator", {"bits": 32, "overflow": overflow})
    assert np.array_equal(dal.npu.load(exact_model).run_layerwise(ref)[step.outputs[0]], exact)
