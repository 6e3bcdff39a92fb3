"""Bundled recipes load, round-trip, and fit (or are refused by) the hardware they target."""
from pathlib import Path

import pytest

from dal.config.bundled import find_bundled
from dal.recipe import Recipe, RecipeError, check_against_hardware, list_recipes, load_recipe

RECIPES = ("fp16_precision", "int8_balanced", "int8_sparse24", "w4a8_fp8_performance")
MEANT_FOR = {
    "fp16_precision": ("a2000", "generic_int8"),
    "int8_balanced": ("a1000", "a2000", "generic_int8"),
    "int8_sparse24": ("a1000", "a2000", "generic_int8"),  # left dense off the a2000
    "w4a8_fp8_performance": ("a2000",),
}
REFUSED = {
    ("fp16_precision", "a1000"): ["fp16"],
    ("w4a8_fp8_performance", "a1000"): ["fp8_e4m3", "int4"],
    ("w4a8_fp8_performance", "generic_int8"): ["fp8_e4m3", "int4"],
}

# A small CNN + transformer block, as (module name, class name, op class).
LAYERS = [
    ("features.0", "Conv2d", "conv"), ("features.1", "ReLU", "activation"),
    ("features.2", "MaxPool2d", "pool"), ("features.3", "Conv2d", "conv"),
    ("layer1.0.add", "QAdd", "add"), ("up", "Upsample", "resize"), ("cat", "QCat", "cat"),
    ("emb", "Embedding", "embedding"), ("blk.attn.qk", "QMatMul", "matmul"),
    ("blk.attn.softmax", "Softmax", "softmax"), ("blk.attn.proj", "Linear", "linear"),
    ("blk.norm", "LayerNorm", "layernorm"), ("blk.mlp.act", "GELU", "activation"),
    ("classifier", "Linear", "linear"),
]


def test_bundled_names():
    assert set(RECIPES) <= set(list_recipes())


@pytest.mark.parametrize("name", RECIPES)
def test_loads_and_round_trips(name, tmp_path):
    recipe = load_recipe(name)
    assert isinstance(recipe, Recipe) and recipe.name == name and recipe.rules
    assert recipe.source == str(find_bundled("recipes", name)) and Path(recipe.source).is_file()  # openable
    assert load_recipe(recipe.to_dict()) == recipe
    path = tmp_path / "saved.yaml"
    recipe.to_yaml(path)
    assert load_recipe(path) == recipe
    assert load_recipe(recipe) is recipe


@pytest.mark.parametrize("name,hw", [(r, h) for r, hws in MEANT_FOR.items() for h in hws])
def test_fits_intended_hardware(name, hw):
    report = check_against_hardware(name, hw)
    assert report.hardware == hw
    check_against_hardware(name, hw, LAYERS)


@pytest.mark.parametrize("name,hw", list(REFUSED))
def test_refused_with_named_format(name, hw):
    with pytest.raises(RecipeError) as err:
        check_against_hardware(name, hw)
    text = str(err.value)
    assert f"hardware {hw!r}" in text and f"recipes/{name}.yaml:" in text
    for fmt in REFUSED[(name, hw)]:
        assert f"format {fmt} is not supported" in text
    assert "allowed" in text and "fix:" in text


def test_int8_balanced_defaults():
    r = load_recipe("int8_balanced")
    conv = r.resolve("features.0", "Conv2d", "conv")
    assert conv.weight.format.name == "int8" and conv.weight.granularity == "per_channel"
    assert conv.weight.symmetric and conv.weight.observer == "minmax"
    assert conv.input.format.name == "uint8" and conv.input.granularity == "per_tensor"
    assert not conv.input.symmetric and conv.input.observer == "moving_average"
    assert r.resolve("classifier", "Linear", "linear").weight.format.name == "int8"  # kept int8
    assert r.resolve("blk.attn.softmax", "Softmax", "softmax").fallback_fp16


def test_w4a8_formats():
    r = load_recipe("w4a8_fp8_performance")
    lin = r.resolve("blk.attn.proj", "Linear", "linear")
    assert lin.weight.format.name == "int4" and lin.weight.granularity == "per_group"
    assert lin.weight.group_size == 32 and lin.input.format.name == "int8"
    conv = r.resolve("features.0", "Conv2d", "conv")
    assert conv.weight.format.name == "int4" and conv.weight.granularity == "per_channel"
    mm = r.resolve("blk.attn.qk", "QMatMul", "matmul")
    assert mm.input.format.name == "fp8_e4m3" and mm.weight is None
    assert "npu_attention" in r.replace


def test_int8_sparse24_left_dense_off_a2000():
    r = load_recipe("int8_sparse24")
    assert r.resolve("features.0", "Conv2d", "conv").sparsity == "2:4"
    assert r.resolve("classifier", "Linear", "linear").sparsity == "2:4"
    assert check_against_hardware(r, "a2000", LAYERS).left_dense == ()
    report = check_against_hardware(r, "a1000", LAYERS)
    dense = "\n".join(report.left_dense)
    assert "features.0" in dense and "classifier" in dense and "stay dense" in dense
    assert r.resolve_checked("features.0", "Conv2d", "conv", hardware="a1000").sparsity is None
    assert r.resolve_checked("features.0", "Conv2d", "conv", hardware="a2000").sparsity == "2:4"


def test_fp16_precision_everything_fp16():
    r = load_recipe("fp16_precision")
    for name, type_name, op_class in LAYERS:
        spec = r.resolve(name, type_name, op_class)
        for role in ("weight", "input", "output"):
            s = getattr(spec, role)
            assert s is None or s.format.name == "fp16"
