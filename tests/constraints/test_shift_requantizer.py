"""dal.npu's shift-only requantizer (``dal.requantizer`` kind power_of_two), bit for bit against
the float64 model of the rule in ref64.py, for each rounding of ties; a file whose scales are
not powers of two is refused."""
import numpy as np
import onnx
import pytest
import torch

import dal
from constraints_common import CatNet, export, ort_all, set_meta
from ref64 import run_group


@pytest.fixture(scope="module")
def pow2_file(tmp_path_factory):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8, 8)
    m = dal.prepare_qat(CatNet(), recipe="pow2_int8", hardware="pow2_int8", example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(m, [(torch.randn(2, 3, 8, 8),) for _ in range(3)], progress=False)
    return export(m, x, tmp_path_factory.mktemp("shift") / "m.onnx")


@pytest.mark.parametrize("rounding", ["half_up", "half_even", "half_away"])
def test_shift_requantizer_is_bit_exact_against_float64(pow2_file, rounding, npu_lib):
    import dal.npu
    model = set_meta(pow2_file, "dal.requantizer", {"kind": "power_of_two", "rounding": rounding})
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32) * 2
    ref = ort_all(pow2_file, {"input": x})  # each layer's input codes: onnxruntime's (layer by layer)
    sess = dal.npu.load(model)
    fused = [s for s in sess.steps if type(s).__name__ == "FusedStep"]
    assert len(fused) == 3
    got = sess.run_layerwise(ref)
    ties = 0
    for step in fused:
        want, acc = run_group(model, step.node_name, ref[step.inputs[0]], "power_of_two", rounding)
        assert np.array_equal(got[step.outputs[0]], want), step.node_name
        other, _ = run_group(model, step.node_name, ref[step.inputs[0]], "power_of_two",
                             "half_even" if rounding != "half_even" else "half_up")
        ties += int((other != want).sum())
    assert ties > 0  # ties occurred, so the rounding rule was exercised


def test_a_scale_that_is_not_a_power_of_two_is_refused(pow2_file):
    import dal.npu
    m = onnx.ModelProto()
    m.CopyFrom(pow2_file)
    conv = next(n for n in m.graph.node if n.op_type == "Conv")
    q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == next(
        c.output[0] for c in m.graph.node if c.op_type == "Relu" and c.input[0] == conv.output[0]))
    init = next(i for i in m.graph.initializer if i.name == q.input[1])
    arr = onnx.numpy_helper.to_array(init) * np.float32(1.5)
    init.CopyFrom(onnx.numpy_helper.from_array(arr.astype(np.float32), init.name))
    with pytest.raises(dal.npu.NPUError, match=rf"{conv.name}.*power_of_two requantizer needs s_x \* s_w / s_y = 2\^-n"):
        dal.npu.load(m)
