"""Recipes that follow practice: ``ptq:`` steps, ``position: first|last`` rules (W4 recipes keep
the first conv and the last linear INT8; an override keeps INT4), learnable (LSQ) W4A8, scale-only QAT."""
import pytest
import torch

import dal
from dal.recipe.errors import RecipeError
from dal_examples.zoo import MnistCNN

X = torch.zeros(2, 1, 28, 28)


def _weight_formats(model):
    return {n: m.weight_quant.fmt.name for n, m in model.named_modules() if getattr(m, "weight_quant", None) is not None}


def test_w4a8_keeps_first_conv_and_last_linear_int8():
    q = dal.prepare_qat(MnistCNN(), recipe="w4a8_fp8_performance", hardware="a2000", example_inputs=(X,))
    assert _weight_formats(q) == {"stem.0": "int8", "down.0": "int4", "conv": "int4", "down2.0": "int4",
                                  "head": "int8"}
    # The recipe attached to the model names the two layers it picked.
    rules = dal.prepared(q).recipe.rules
    assert [r.match for r in rules if r.match] == [("stem.0",), ("head",)]


def test_yaml_override_keeps_int4(tmp_path):
    text = (tmp_path / "w4.yaml")
    from pathlib import Path

    src = (Path(__file__).parents[2] / "recipes" / "w4a8_fp8_performance.yaml").read_text()
    text.write_text(src.replace("    position: first\n    weight: &w_int8 {format: int8",
                                "    position: first\n    weight: &w_int8 {format: int4"))
    q = dal.prepare_qat(MnistCNN(), recipe=str(text), hardware="a2000", example_inputs=(X,))
    assert set(_weight_formats(q).values()) == {"int4"}


def test_unbound_position_rule_matches_nothing():
    r = dal.load_recipe("w4a8_fp8_performance")
    assert r.resolve("features.0", "Conv2d", "conv").weight.format.name == "int4"
    bound = r.bind_positions([("a", "Conv2d", "conv"), ("b", "Conv2d", "conv"), ("fc", "Linear", "linear")])
    assert bound.resolve("a", "Conv2d", "conv").weight.format.name == "int8"
    assert bound.resolve("b", "Conv2d", "conv").weight.format.name == "int4"
    assert bound.resolve("fc", "Linear", "linear").weight.format.name == "int8"


def test_ptq_key_round_trips_and_bad_step_names_file_and_line(tmp_path):
    good = tmp_path / "r.yaml"
    good.write_text("name: r\nptq: [equalize, adaround, bias_correction]\nrules:\n  - type: conv\n"
                    "    weight: int8\n")
    r = dal.load_recipe(str(good))
    assert r.ptq == ("equalize", "adaround", "bias_correction")
    assert dal.load_recipe(r.to_dict()) == r
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: r\nptq:\n  - equalize\n  - adaroud\nrules:\n  - type: conv\n    weight: int8\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml:4.*'adaroud' is not allowed; did you mean 'adaround'"):
        dal.load_recipe(str(bad))
    pos = tmp_path / "pos.yaml"
    pos.write_text("name: r\nrules:\n  - type: conv\n    position: middle\n    weight: int8\n")
    with pytest.raises(RecipeError, match=r"pos\.yaml:4.*'middle' is not allowed"):
        dal.load_recipe(str(pos))


def test_recipe_ptq_steps_run_and_export_standard_qdq(tmp_path):
    import onnx

    from dal.ptq import quantize_ptq
    from ptq_helpers import mnist_batches

    _, calib, _ = mnist_batches(n_train=64, calib=64, test=256)
    rec = {"name": "r", "ptq": ["equalize", "adaround", "bias_correction"], "rules": [
        {"type": ["conv", "linear"], "weight": {"format": "int4", "granularity": "per_channel"},
         "input": {"format": "int8", "symmetric": False}},
        {"type": ["add", "pool"], "input": {"format": "int8", "symmetric": False}}]}
    q = quantize_ptq(MnistCNN().eval(), rec, calib, hardware="a2000", adaround_args={"iters": 10})
    path = tmp_path / "m.onnx"
    dal.export_onnx(q, (X[:1],), str(path))
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    assert ops <= {"QuantizeLinear", "DequantizeLinear", "Conv", "Relu", "Add", "MaxPool", "Flatten", "Gemm",
                   "Reshape", "MatMul", "Identity", "Constant", "Shape", "Gather", "Unsqueeze", "Concat"}


def test_lsq_recipe_and_scale_only_mode():
    from dal.ptq import scales_only
    from ptq_helpers import mnist_batches

    train, calib, _ = mnist_batches(n_train=128, calib=64, test=256)
    q = dal.prepare_qat(MnistCNN(), recipe="w4a8_lsq", hardware="a2000", example_inputs=(X,))
    dal.calibrate(q, calib, progress=False)
    params = scales_only(q)
    assert params and all(p.requires_grad for p in params)
    weights = {n: p.detach().clone() for n, p in q.named_parameters() if n.endswith("weight")}
    scales = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1e-3)
    q.train()
    for x, y in train[:2]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(q(x), y).backward()
        opt.step()
    assert all(torch.equal(p, weights[n]) for n, p in q.named_parameters() if n in weights)  # weights frozen
    assert any(not torch.equal(a, b.detach()) for a, b in zip(scales, params))  # scales learned
    with pytest.raises(ValueError, match="no learnable quantizer"):
        scales_only(dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(X,)))
