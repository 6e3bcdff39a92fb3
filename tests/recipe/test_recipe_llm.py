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
        assert (q.weight.granularity, q.weight.group_size, q.weight.axis, q.weight.symmetric) == ("per_group", 32, 1, True)
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
