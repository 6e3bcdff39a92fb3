"""A recipe asking for what the hardware cannot do is refused, every offender listed at once."""
import pytest

from dal.recipe import RecipeError, check_against_hardware, load_recipe


def recipe(*rules, **kw):
    return load_recipe({"name": "t", "rules": list(rules), **kw})


LAYERS = [("features.0", "Conv2d", "conv"), ("layer1.0.conv1", "Conv2d", "conv"),
          ("fc", "Linear", "linear"), ("attn.qk", "QMatMul", "matmul"), ("act", "ReLU", "activation")]


def test_all_offending_layers_listed_at_once():
    r = recipe({"type": "conv", "weight": "int4", "input": "uint8"},
               {"type": "linear", "weight": "fp8_e4m3", "input": "int8"},
               {"type": "matmul", "input": "fp8_e5m2"},
               {"type": "activation", "input": "uint8"})
    with pytest.raises(RecipeError) as err:
        check_against_hardware(r, "a1000", LAYERS)
    text = str(err.value)
    assert "4 problems" in text and "hardware 'a1000'" in text
    for layer in ("features.0", "layer1.0.conv1", "fc", "attn.qk"):
        assert f"layer {layer!r}" in text
    assert "format int4 is not supported" in text and "format fp8_e4m3" in text and "fp8_e5m2" in text
    assert "allowed: int8" in text
    assert "{match: 'fc', skip: true}" in text  # what to do
    assert "act" not in {p.message.split("'")[1] for p in err.value.problems}


def test_rule_level_check_names_rule_file_and_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("rules:\n  - type: conv\n    weight: int8\n  - type: linear\n    weight: int4\n")
    with pytest.raises(RecipeError) as err:
        check_against_hardware(path, "a1000")
    (p,) = err.value.problems
    assert p.source == str(path) and p.line == 4 and p.key == "rules[1].weight"
    assert "rule 1 (type linear)" in p.message and "allowed there: int8" in p.message


def test_weight_rules_enforced():
    r = recipe({"type": "linear", "weight": {"format": "int4", "granularity": "per_group", "group_size": 16}},
               {"type": "conv", "weight": {"format": "int8", "symmetric": False}})
    with pytest.raises(RecipeError) as err:
        check_against_hardware(r, "a2000")
    text = str(err.value)
    assert "group_size 16 is not supported (allowed: 32, 64, 128)" in text
    assert "asymmetric weights are not supported" in text
    # generic_int8 allows affine weights but no per_group
    r2 = recipe({"type": "conv", "weight": {"format": "int8", "symmetric": False}})
    check_against_hardware(r2, "generic_int8")
    r3 = recipe({"type": "linear", "weight": {"format": "int8", "granularity": "per_group", "group_size": 32}})
    with pytest.raises(RecipeError, match="granularity per_group is not supported"):
        check_against_hardware(r3, "generic_int8")


def test_activation_per_channel_refused():
    r = recipe({"type": "add", "input": {"format": "int8", "granularity": "per_channel"}})
    with pytest.raises(RecipeError, match="activation granularity per_channel"):
        check_against_hardware(r, "a2000")


def test_sparsity_on_dense_op_is_left_dense_not_error():
    r = recipe({"type": ["conv", "linear"], "weight": "int8", "sparsity": "2:4"})
    report = check_against_hardware(r, "a1000")
    assert len(report.left_dense) == 2 and "stay dense" in report.left_dense[0]
    r2 = recipe({"type": "conv_transpose", "weight": "int8", "sparsity": "2:4"})
    report = check_against_hardware(r2, "a2000", [("up", "ConvTranspose2d", "conv_transpose")])
    assert "up" in report.left_dense[0] and "conv, linear, matmul" in report.left_dense[0]


def test_fallback_without_fp16_is_a_note():
    r = recipe({"match": "fc", "fallback": "fp16"}, {"type": "linear", "weight": "int8"})
    report = check_against_hardware(r, "a1000", [("fc", "Linear", "linear")])
    assert any("outside the NPU" in n for n in report.notes)
    assert not any("outside the NPU" in n for n in check_against_hardware(r, "a2000", [("fc", "Linear", "linear")]).notes)


def test_rules_matching_no_layer_are_noted():
    r = recipe({"match": "typo.*", "fallback": "fp16"}, {"type": "conv", "weight": "int8"})
    report = check_against_hardware(r, "a2000", [("features.0", "Conv2d", "conv")])
    assert any("rule 0" in n and "matched no layer" in n for n in report.notes)
    assert "fits hardware 'a2000'" in str(report)


def test_earlier_type_rule_shadows_later_catch_all():
    # softmax / layernorm are taken by rule 0, so the uint8 catch-all never reaches them on the a2000
    r = recipe({"type": ["softmax", "layernorm"], "fallback": "fp16"}, {"match": "*", "input": "uint8"})
    with pytest.raises(RecipeError):
        check_against_hardware(recipe({"match": "*", "input": "uint8"}), "a2000")
    check_against_hardware(r, "a2000")


def test_resolve_checked():
    r = recipe({"type": "linear", "weight": "int4", "input": "int8"}, hardware="a2000")
    assert r.resolve_checked("fc", "Linear", "linear").weight.format.name == "int4"
    with pytest.raises(RecipeError, match="layer 'fc'"):
        r.resolve_checked("fc", "Linear", "linear", hardware="a1000")
    assert r.resolve_checked("x", "Conv2d", "conv", hardware="a1000") is None  # no rule: float
    with pytest.raises(RecipeError, match="names no hardware"):
        recipe({"type": "linear", "weight": "int8"}).resolve_checked("fc", "Linear", "linear")


def test_recipe_error_is_value_error():
    assert issubclass(RecipeError, ValueError)
