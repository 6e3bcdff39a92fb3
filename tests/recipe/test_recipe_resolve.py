"""Rule matching: first match wins, globs, regexes, class names and op classes, roles."""
import pytest

from dal.recipe import LayerSpec, Recipe, Rule, TensorSpec, load_recipe

W8 = {"format": "int8"}
A8 = {"format": "uint8"}


def recipe(*rules, **kw):
    return load_recipe({"name": "t", "rules": list(rules), **kw})


def test_first_match_wins():
    r = recipe({"match": "layer1.*", "fallback": "fp16"},
               {"type": "conv", "weight": "int4"},
               {"match": "*", "weight": "int8"})
    a = r.resolve("layer1.0.conv1", "Conv2d", "conv")
    assert a.fallback_fp16 and a.rule_index == 0 and a.weight is None
    b = r.resolve("layer2.0.conv1", "Conv2d", "conv")
    assert b.weight.format.name == "int4" and b.rule_index == 1
    c = r.resolve("fc", "Linear", "linear")
    assert c.weight.format.name == "int8" and c.rule_index == 2
    assert c.rule_source == "<dict>:rules[2]"


def test_glob_matching():
    r = recipe({"match": "features.0.*", "weight": "int4"}, {"match": "layer?.0.conv1", "weight": "int8"})
    assert r.resolve("features.0.conv", "Conv2d", "conv").weight.format.name == "int4"
    assert r.resolve("features.0.a.b", "Conv2d", "conv") is not None  # * crosses dots
    assert r.resolve("features.0", "Conv2d", "conv") is None
    assert r.resolve("features.01", "Conv2d", "conv") is None
    assert r.resolve("layer3.0.conv1", "Conv2d", "conv").weight.format.name == "int8"
    assert r.resolve("layer10.0.conv1", "Conv2d", "conv") is None


def test_regex_matching_is_full_match():
    r = recipe({"match": r"re:layer\d+\.0\.conv\d", "weight": "int8"})
    assert r.resolve("layer12.0.conv2", "Conv2d", "conv") is not None
    assert r.resolve("model.layer1.0.conv1", "Conv2d", "conv") is None
    assert r.resolve("layer1.0.conv1.extra", "Conv2d", "conv") is None


def test_list_of_patterns_any_matches_and_type_must_also_match():
    r = recipe({"match": ["fc", "classifier.*"], "type": "Linear", "fallback": "fp16"})
    assert r.resolve("fc", "Linear", "linear").fallback_fp16
    assert r.resolve("classifier.1", "Linear", "linear").fallback_fp16
    assert r.resolve("classifier.1", "Dropout", None) is None


def test_type_by_class_name_glob_or_op_class():
    r = recipe({"type": "Conv*", "weight": "int4"}, {"type": ["linear", "matmul"], "weight": "int8", "input": "int8"})
    assert r.resolve("c", "Conv2d", "conv").weight.format.name == "int4"
    assert r.resolve("c", "ConvTranspose2d", "conv_transpose").weight.format.name == "int4"
    assert r.resolve("l", "QLinear", "linear").weight.format.name == "int8"
    mm = r.resolve("m", "QMatMul", "matmul")
    assert mm.weight is None and mm.input.format.name == "int8"  # matmul has no weight role


def test_skip_and_no_match_leave_float():
    r = recipe({"match": "head", "skip": True}, {"type": "conv", "weight": "int8"})
    assert r.resolve("head", "Conv2d", "conv") is None
    assert r.resolve("x", "Linear", "linear") is None


def test_rule_with_nothing_for_the_op_class_still_wins_and_leaves_float():
    r = recipe({"match": "*", "weight": "int8"}, {"type": "add", "input": "uint8"})
    assert r.resolve("add", "QAdd", "add") is None
    assert r.match("add", "QAdd", "add") == 0


def test_embedding_has_no_input_and_sparsity_only_where_it_means_something():
    r = recipe({"match": "*", "weight": "int8", "input": "uint8", "output": "int8", "sparsity": "2:4"})
    emb = r.resolve("emb", "Embedding", "embedding")
    assert emb.input is None and emb.output.format.name == "int8" and emb.sparsity == "2:4"
    add = r.resolve("add", "QAdd", "add")
    assert add.sparsity is None and add.weight is None and add.input is not None


def test_unknown_op_class_is_refused():
    r = recipe({"match": "*", "weight": "int8"})
    with pytest.raises(ValueError, match="known op class"):
        r.resolve("x", "Conv2d", "convolution")


def test_role_defaults_and_shorthand():
    r = recipe({"match": "*", "weight": "int8", "input": "int8", "output": "fp8_e4m3"})
    s = r.resolve("x", "Conv2d", "conv")
    assert s.weight == TensorSpec.for_role("int8", "weight")
    assert (s.weight.granularity, s.weight.symmetric, s.weight.axis) == ("per_channel", True, None)
    assert (s.input.granularity, s.input.symmetric, s.input.observer) == ("per_tensor", False, "moving_average")
    assert s.output.symmetric  # fp8 has no zero point
    fp16 = TensorSpec.for_role("fp16", "weight")
    assert fp16.observer == "none" and fp16.granularity == "per_tensor"


def test_full_spec_fields():
    r = recipe({"match": "*", "weight": {"format": "int4", "granularity": "per_group", "group_size": 32,
                                         "axis": 1, "symmetric": True, "narrow_range": True,
                                         "observer": "percentile", "observer_args": {"percentile": 99.9},
                                         "learnable": True}})
    w = r.resolve("fc", "Linear", "linear").weight
    assert (w.format.name, w.granularity, w.group_size, w.axis) == ("int4", "per_group", 32, 1)
    assert w.narrow_range and w.learnable and w.observer == "percentile"
    assert w.observer_args == (("percentile", 99.9),)


def test_round_trip_of_programmatic_recipe(tmp_path):
    r = recipe({"match": ["a.*", r"re:b\d"], "type": ["Conv2d", "linear"], "weight": W8, "input": A8,
                "sparsity": "2:4", "replace": ["conv_bn_relu"]},
               {"type": "softmax", "fallback": "fp16"}, {"match": "head", "skip": True},
               calibration={"method": "percentile", "num_batches": 8, "args": {"percentile": 99.99}},
               replace=["npu_attention"], hardware="a2000", description="d")
    text = r.to_yaml()
    path = tmp_path / "r.yaml"
    path.write_text(text)
    again = load_recipe(path)
    assert again == r and again.to_dict() == r.to_dict()
    first_rule_line = text.splitlines().index("rules:") + 2
    assert again.rules[0].source == f"{path}:{first_rule_line}"


def test_with_rules_prepended():
    base = load_recipe("int8_balanced")
    r2 = base.with_rules_prepended([{"match": "layer1.0.conv1", "fallback": "fp16"},
                                    Rule(match=("fc",), skip=True)])
    assert r2.rules[2:] == base.rules and len(r2.rules) == len(base.rules) + 2
    spec = r2.resolve("layer1.0.conv1", "Conv2d", "conv")
    assert spec.fallback_fp16 and spec.rule_index == 0
    assert r2.resolve("fc", "Linear", "linear") is None
    assert r2.resolve("layer2.0.conv1", "Conv2d", "conv").rule_index == base.resolve(
        "layer2.0.conv1", "Conv2d", "conv").rule_index + 2
    assert load_recipe(r2.to_dict()) == r2
    assert base.rules[0] == load_recipe("int8_balanced").rules[0]  # the original is unchanged


def test_with_rules_prepended_validates():
    from dal.recipe import RecipeError

    with pytest.raises(RecipeError, match="did you mean 'fallback'"):
        load_recipe("int8_balanced").with_rules_prepended([{"match": "x", "fallbak": "fp16"}])


def test_objects_are_hashable_and_frozen():
    r = load_recipe("w4a8_fp8_performance")
    hash(r)
    spec = r.resolve("fc", "Linear", "linear")
    assert isinstance(spec, LayerSpec)
    hash(spec)
    with pytest.raises(Exception):
        r.rules = ()
    assert isinstance(r, Recipe)


def test_yaml_text_instead_of_a_name_or_path_is_named():
    """YAML text passed as a string: one clear error (not the file system's 'File name too long')."""
    import pytest

    import dal
    from dal.hardware.errors import HardwareModelError
    from dal.recipe.errors import RecipeError
    text = "name: mine\nrules:\n  - match: '*'\n" + "#" * 300
    with pytest.raises(RecipeError, match="neither a bundled name nor a file path.*yaml.safe_load"):
        dal.load_recipe(text)
    with pytest.raises(HardwareModelError, match="neither a bundled name nor a file path"):
        dal.load_hardware("name: x\nengines: {}\n")
