"""The LLM recipes (w4a8_fp8_llm, w4a8_int8_llm, w8a8_llm): they load and round-trip, fit the
hardware they are meant for, are refused elsewhere naming the format, and resolve the layers of a
decoder as their comments say (lm_head = the last linear, embeddings per row)."""
from pathlib import Path

import pytest

from dal.config.bundled import find_bundled
from dal.recipe import RecipeError, check_against_hardware, list_recipes, load_recipe

LLM_RECIPES = ("w4a8_fp8_llm", "w4a8_int8_llm", "w8a8_llm")
MEANT_FOR = {"w4a8_fp8_llm": ("a2000",), "w4a8_int8_llm": ("a2000",), "w8a8_llm": ("a1000", "a2000", "generic_int8")}
REFUSED = {("w4a8_fp8_llm", "a1000"): ["int4", "fp8_e4m3"], ("w4a8_fp8_llm", "generic_int8"): ["int4", "fp8_e4m3"],
           ("w4a8_int8_llm", "a1000"): ["int4"], ("w4a8_int8_llm", "generic_int8"): ["int4"]}

# The layers of a small Llama-style decoder, (path, class name, op class), in registration order.
DECODER = [("model.embed_tokens", "Embedding", "embedding")]
for i in range(2):
    DECODER += [(f"model.layers.{i}.self_attn.{p}_proj", "Linear", "linear") for p in "qkvo"]
    DECODER += [(f"model.layers.{i}.self_attn.qk", "QMatMul", "matmul"),
                (f"model.layers.{i}.self_attn.softmax", "Softmax", "softmax")]
    DECODER += [(f"model.layers.{i}.mlp.{p}_proj", "Linear", "linear") for p in ("gate", "up", "down")]
    DECODER += [(f"model.layers.{i}.mlp.mul", "QMul", "mul"),
                (f"model.layers.{i}.input_layernorm", "LlamaRMSNorm", "layernorm")]
DECODER += [("model.norm", "LlamaRMSNorm", "layernorm"), ("lm_head", "Linear", "linear")]


def test_listed():
    assert set(LLM_RECIPES) <= set(list_recipes())
    table = Path(find_bundled("recipes", "int8_balanced")).with_name("README.md").read_text()
    for name in LLM_RECIPES:
        assert f"| `{name}.yaml` |" in table


@pytest.mark.parametrize("name", LLM_RECIPES)
def test_loads_and_round_trips(name, tmp_path):
    recipe = load_recipe(name)
    assert recipe.name == name and recipe.source == str(find_bundled("recipes", name))
    assert load_recipe(recipe.to_dict()) == recipe
    recipe.to_yaml(tmp_path / "saved.yaml")
    assert load_recipe(tmp_path / "saved.yaml") == recipe


@pytest.mark.parametrize("name,hw", [(r, h) for r, hws in MEANT_FOR.items() for h in hws])
def test_fits_intended_hardware(name, hw):
    check_against_hardware(name, hw)
    check_against_hardware(load_recipe(name).bind_positions(DECODER), hw, DECODER)


@pytest.mark.parametrize("name,hw", list(REFUSED))
def test_refused_elsewhere_naming_the_format(name, hw):
    """Also without layers: the rule for every linear is checked although a `position: last`
    linear rule comes before it (that rule decides for one module, not for the op class)."""
    with pytest.raises(RecipeError) as err:
        check_against_hardware(name, hw)
    text = str(err.value)
    assert f"hardware {hw!r}" in text and f"recipes/{name}.yaml:" in text and "fix:" in text
    for fmt in REFUSED[(name, hw)]:
        assert f"format {fmt} is not supported" in text


@pytest.mark.parametrize("name", LLM_RECIPES)
def test_decoder_layers_resolve(name):
    recipe = load_recipe(name).bind_positions(DECODER)
    w4 = name.startswith("w4")
    q = recipe.resolve("model.layers.0.self_attn.q_proj", "Linear", "linear")
    assert q.weight.format.name == ("int4" if w4 else "int8")
    if w4:
        # axis None: the layer's input axis (1 for a Linear, 0 for transformers' Conv1D)
        assert (q.weight.granularity, q.weight.group_size, q.weight.axis, q.weight.symmetric) == \
            ("per_group", 32, None, True)
    assert q.input.format.name == ("fp8_e4m3" if name == "w4a8_fp8_llm" else "int8")
    assert q.input.granularity == "per_tensor"  # static: one calibrated scale
    head = recipe.resolve("lm_head", "Linear", "linear")  # the last linear: its own rule
    emb = recipe.resolve("model.embed_tokens", "Embedding", "embedding")
    for spec in (head.weight, emb.weight):  # int8 per row (axis 0 of both: a tied table agrees)
        assert (spec.format.name, spec.granularity, spec.symmetric) == ("int8", "per_channel", True)
    assert head.input.format.name == "int8" and head.rule_index != q.rule_index
    assert recipe.resolve("model.norm", "LlamaRMSNorm", "layernorm").fallback_fp16
    assert recipe.resolve("model.layers.0.self_attn.softmax", "Softmax", "softmax").fallback_fp16
    mul = recipe.resolve("model.layers.0.mlp.mul", "QMul", "mul")
    assert mul.input.format.name == "int8"  # the vector engine has no fp8
    mm = recipe.resolve("model.layers.0.self_attn.qk", "QMatMul", "matmul")
    assert mm.input.format.name == ("fp8_e4m3" if name == "w4a8_fp8_llm" else "int8")


# -- bad input: each refusal names the culprit and what would work --------------------------------

def _mlp(*sizes):
    import torch.nn as nn

    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_group_size_that_does_not_divide_is_refused_by_layer():
    import dal

    # Linears 0, 2, 4, 6 have in_features 64, 96, 80, 16: a rule giving linear 2 groups of 64
    # is refused naming 32 as what divides 96; 80 has no a2000 group size; 6 is lm_head (int8).
    recipe = load_recipe("w4a8_int8_llm").with_rules_prepended(
        [{"match": "2", "type": "linear", "weight": {"format": "int4", "granularity": "per_group", "group_size": 64}}])
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(_mlp(64, 96, 80, 16, 10), recipe=recipe, hardware="a2000")
    text = str(err.value)
    assert "2 problems" in text and " 2 (Linear): in_features 96 is not divisible by the weight group_size 64" in text
    assert "group sizes that divide 96 on a2000: 32" in text
    assert " 4 (Linear): in_features 80 is not divisible by the weight group_size 32" in text
    assert "no group size a2000 allows (32, 64, 128) divides 80" in text and "granularity: per_channel" in text
    assert " 0 (Linear)" not in text and " 6 (Linear)" not in text  # 64 divides; 6 has the lm_head rule


def test_per_token_activations_refused_naming_the_hardware_file():
    recipe = {"name": "dyn", "rules": [{"type": "linear", "weight": "int8",
                                        "input": {"format": "int8", "granularity": "per_token"}}]}
    for hw in ("a2000", "a1000"):
        with pytest.raises(RecipeError) as err:
            check_against_hardware(recipe, hw)
        text = str(err.value)
        assert "dynamic per-token activation scales" in text and f"hardware {hw!r}" in text
        assert f"hardware_models/{hw}.yaml" in text and "granularity: per_tensor" in text
    with pytest.raises(RecipeError, match="per_token .* is for activations"):
        load_recipe({"name": "w", "rules": [{"type": "linear", "weight": {"format": "int8", "granularity": "per_token"}}]})


def test_per_token_declared_by_hardware_is_refused_by_layer_not_trained_as_something_else():
    import dal
    from dal.hardware import load_hardware

    hw = load_hardware("a2000").to_dict()
    hw["activation_rules"]["granularities"] = ["per_tensor", "per_token"]
    recipe = {"name": "dyn", "rules": [{"type": "linear", "weight": "int8",
                                        "input": {"format": "int8", "granularity": "per_token"}}]}
    check_against_hardware(recipe, load_hardware(hw))  # the recipe fits that hardware
    with pytest.raises(RecipeError, match=r"0 \(Linear\): input per_token .* not implemented"):
        dal.prepare_qat(_mlp(8, 8), recipe=recipe, hardware=load_hardware(hw))


def test_int4_activations_refused_on_hardware_without_them():
    recipe = {"name": "a4", "rules": [{"type": "linear", "weight": "int4", "input": {"format": "int4"}}]}
    with pytest.raises(RecipeError) as err:
        check_against_hardware(recipe, "a2000", [("fc", "Linear", "linear")])
    text = str(err.value)
    assert "layer 'fc'" in text and "input format int4 is not supported by hardware 'a2000'" in text
    assert "allowed: uint8, int8, fp8_e4m3, fp8_e5m2, fp16" in text


def test_model_without_layers_to_quantize_is_refused():
    import torch.nn as nn

    import dal

    with pytest.raises(ValueError) as err:
        dal.prepare_qat(nn.Sequential(nn.ReLU(), nn.LayerNorm(8)), recipe="w8a8_llm", hardware="a2000")
    text = str(err.value)
    assert "quantizes nothing in Sequential" in text and "Linear" in text and "Conv2d" in text
    assert "register_qat_module" in text
