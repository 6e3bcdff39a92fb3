"""INT16 as the step between INT8 and FP16 of the sensitivity fallback (dal.analysis.auto_fallback
and dal.auto_quantize): on pow2_int8, whose conv takes int16 inputs, the sensitive layer moves to
INT16 first, and the result exports and runs on dal.npu layer by layer within 1 LSB of
onnxruntime; on a2000, whose conv lists no int16 input, it goes to FP16."""
import warnings

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import dal
from dal.recipe.load import load_recipe


class Net(nn.Module):
    """b's input is sensitive: one channel of relu(a(x)) is 200x the others and b ignores it
    (zero weights), so INT8 codes over that range crush the channels b uses; INT16 keeps them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8 * 64, 10)
        with torch.no_grad():
            self.a.weight[0] *= 200.0
            self.a.bias[0] = 1.0
            self.b.weight[:, 0] = 0.0

    def forward(self, x):
        return self.fc(torch.relu(self.b(torch.relu(self.a(x)))).flatten(1))


def _data():
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(8, 3, 8, 8)
    batches = [(x[:4],), (x[4:],)] * 2  # two batches seen twice: the ranges calibration sees are the data's
    return net, batches


def _prepared(net, batches, recipe, hardware):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = dal.prepare_qat(net, recipe=recipe, hardware=hardware, example_inputs=batches[0], inplace=False)
        dal.calibrate(m, batches, progress=False)
    return m


def _cosine(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def pow2_fallback():
    net, batches = _data()
    m = _prepared(net, batches, "pow2_int8", "pow2_int8")
    return net, batches, dal.analysis.auto_fallback(m, batches, target=0.99, float_model=net, progress=False)


def test_pow2_int8_steps_the_sensitive_layer_to_int16_first(pow2_fallback):
    _, _, res = pow2_fallback
    assert res.baseline < 0.99 and res.met
    # the first move of the greedy search is b's INT16 step, and it is the one kept
    assert res.history[1][0] == ["b"] and res.formats == {"b": "int16"}
    (rule,) = [r for r in res.recipe.rules if r.match == ("b",)]
    assert rule.input.format.name.lower() == "int16" and rule.input.symmetric and not rule.fallback_fp16
    assert rule.weight.format.name.lower() == "int8"  # the weights keep their spec
    q = res.model
    assert q.b.input_quant.fmt.name.lower() == "int16" and q.b.weight_quant.fmt.name.lower() == "int8"
    assert q.a.input_quant.fmt.name.lower() == "uint8"
    # the scale the hardware demands: 2^k exactly (the float32 bits: mantissa zero)
    bits = q.b.input_quant.scale.numpy().astype(np.float32).view(np.uint32)
    assert ((bits & 0x7FFFFF) == 0).all()
    assert res.verified_metric >= 0.99 and res.verified_metric > res.baseline


def test_int16_fallback_exports_and_runs_layer_by_layer_on_the_npu(pow2_fallback, tmp_path):
    _, batches, res = pow2_fallback
    q = res.model.eval()
    x = batches[0][0]
    path = tmp_path / "fallback16.onnx"
    dal.export_onnx(q, (x,), str(path))
    model = onnx.load(str(path))
    init = {i.name: i for i in model.graph.initializer}
    assert init["b.input_quant.zero_point"].data_type == onnx.TensorProto.INT16
    assert init["a.input_quant.zero_point"].data_type == onnx.TensorProto.UINT8
    report = dal.verify(str(path), q, (x,))
    assert report.requantizer == "power_of_two"
    assert report.layers_forced and report.max_layer_lsb_forced <= 1  # layer by layer vs onnxruntime
    assert report.meets_criterion(), str(report)


def test_a2000_without_int16_conv_inputs_goes_to_fp16():
    net, batches = _data()
    m = _prepared(net, batches, "int8_balanced", "a2000")
    assert dal.analysis.int16_step.int16_rule(m, "b") is None  # a2000's conv: no int16 input
    res = dal.analysis.auto_fallback(m, batches, target=0.99, progress=False)
    assert res.met and res.formats == {"b": "fp16"}
    base = {str(r.to_dict()) for r in load_recipe("int8_balanced").rules}  # its deformable_attention rule is int16
    assert all("int16" not in str(r.to_dict()) for r in res.recipe.rules if str(r.to_dict()) not in base)
    (rule,) = [r for r in res.recipe.rules if r.match == ("b",)]
    assert rule.fallback_fp16


@pytest.mark.parametrize("hardware, recipe, step", [("pow2_int8", "pow2_int8", "int16"),
                                                    ("a2000", "int8_balanced", "fp16")])
def test_auto_quantize_ladder_takes_int16_where_the_hardware_offers_it(hardware, recipe, step):
    net, batches = _data()
    x = torch.cat([b[0] for b in batches])
    with torch.no_grad():
        want = net(x)

    def cosine(m):
        with torch.no_grad():
            return _cosine(m(x), want)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = dal.auto_quantize(net, batches, cosine, max_drop=0.01, hardware=hardware, recipe=recipe,
                                progress=False, max_layers=1, adaround_args={"iters": 5})
    fallback = [r.name for r in res.rungs if r.name.startswith("fallback")]
    assert fallback and fallback[0] == f"fallback b -> {step}", [r.name for r in res.rungs]
    assert res.status == "fallback" and res.chosen == f"fallback b -> {step}"
    spec = res.recipe.resolve("b", "Conv2d", "conv")
    if step == "int16":
        assert spec.input.format.name.lower() == "int16" and spec.weight.format.name.lower() == "int8"
    else:
        assert spec.fallback_fp16


def test_the_hardware_model_decides_int16():
    """The same layer on a2000 with int16 added to the matrix engine and conv's formats gets the INT16 step;
    on a1000 (int8/uint8 conv inputs only) it does not."""
    from dal.hardware import load_hardware

    net, batches = _data()
    hw = load_hardware("a2000").to_dict()
    engine = hw["engines"]["matrix"]
    engine["formats"] = list(engine["formats"]) + ["int16"]
    hw["ops"]["conv"] = dict(hw["ops"]["conv"], input_formats=hw["ops"]["conv"]["input_formats"] + ["int16"],
                             output_formats=hw["ops"]["conv"]["output_formats"] + ["int16"])
    rule = dal.analysis.int16_step.int16_rule(_prepared(net, batches, "int8_balanced", hw), "b")
    assert rule is not None and rule["input"]["format"] == "int16" and rule["weight"]["format"] == "int8"
    assert dal.analysis.int16_step.int16_rule(_prepared(net, batches, "int8_balanced", "a1000"), "b") is None


def test_no_fp16_step_is_proposed_on_int8_only_hardware(pow2_fallback):
    """pow2_int8 lists no fp16 for any op class: every move the search tried is INT16, none FP16
    (an FP16 layer would leave the NPU), and the layers without an int16 step get no move at all."""
    from dal.analysis.int16_step import fp16_allowed, precision_steps

    net, batches, res = pow2_fallback
    for name in ("a", "b", "fc"):
        assert not fp16_allowed(res.model, name)
        assert precision_steps(res.model, name, None) == ()
    assert all(f == "int16" for f in res.formats.values())
    on_a2000 = _prepared(net, batches, "int8_balanced", "a2000")
    assert precision_steps(on_a2000, "b", None) == ("fp16",)  # the a2000's conv runs in fp16


def test_a_prepared_model_as_float_model_is_refused():
    net, batches = _data()
    m = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=batches[0])  # in place
    with pytest.raises(ValueError, match="float_model is a prepared model.*deepcopy"):
        dal.analysis.auto_fallback(m, batches, target=0.99, float_model=net, progress=False)
