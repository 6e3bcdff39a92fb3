"""Hugging Face models built from tiny configs through the one-line flow (issue 42, items 1-2).

On the a2000: prepare_qat, calibrate (2 batches), 3 training steps with the model's own loss
(``labels=``) and a finite gradient on every trainable parameter, and ``generate`` for 8 tokens
(decoders), with int8_balanced and, for decoders, w4a8_fp8_llm. On the a1000 with int8_balanced:
the flow passes, or prepare refuses naming the module path of every offender. Bad input: a
group size that does not divide a layer, refused by path with the sizes that would.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402
from dal.recipe import RecipeError  # noqa: E402

T = pytest.importorskip("transformers")

H = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
         max_position_embeddings=64)


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(**H, num_key_value_heads=2))


def _qwen2():
    return T.Qwen2ForCausalLM(T.Qwen2Config(**H, num_key_value_heads=2))


def _mistral():
    return T.MistralForCausalLM(T.MistralConfig(**H, num_key_value_heads=2, sliding_window=None))


def _phi():
    return T.PhiForCausalLM(T.PhiConfig(**H))


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64))


def _bert():
    return T.BertForMaskedLM(T.BertConfig(**H))


def _vit():
    return T.ViTForImageClassification(T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128, image_size=32, patch_size=8, num_labels=3))


def _whisper():
    return T.WhisperForAudioClassification(T.WhisperConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16, vocab_size=256,
        num_labels=3))


def _tokens(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 16), generator=g)
    return (ids,), {"labels": ids}


def _pixels(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 32, 32, generator=g),), {"labels": torch.tensor([0, 2])}


def _audio(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 32, generator=g),), {"labels": torch.tensor([1, 2])}


# name -> (builder, batch(seed) -> (args, kwargs with labels), decoder)
MODELS = {"llama": (_llama, _tokens, True), "qwen2": (_qwen2, _tokens, True), "mistral": (_mistral, _tokens, True),
          "phi": (_phi, _tokens, True), "gpt2": (_gpt2, _tokens, True), "bert": (_bert, _tokens, False),
          "vit": (_vit, _pixels, False), "whisper": (_whisper, _audio, False)}
RMSNORM_MODELS = ("llama", "qwen2", "mistral")
ROTARY_MODELS = ("llama", "qwen2", "mistral", "phi")
A2000_CASES = [(m, "int8_balanced") for m in MODELS] + [(m, "w4a8_fp8_llm") for m, v in MODELS.items() if v[2]]


def _flow(name, recipe, hardware):
    build, batch, decoder = MODELS[name]
    torch.manual_seed(0)
    model = build()
    p = dal.prepare_qat(model, recipe=recipe, hardware=hardware)
    dal.calibrate(p, [batch(1)[0][0], batch(2)[0][0]], progress=False)
    p.train()
    params = [q for q in p.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    for step in range(3):
        args, kwargs = batch(10 + step)
        opt.zero_grad()
        loss = p(*args, **kwargs).loss
        assert torch.isfinite(loss), f"{name}: loss {loss} at step {step}"
        loss.backward()
        bad = [n for n, q in p.named_parameters() if q.requires_grad and
               (q.grad is None or not torch.isfinite(q.grad).all())]
        assert not bad, f"{name}: no or non-finite gradient at step {step}: {bad[:5]}"
        opt.step()
    if decoder:
        p.eval()
        prompt = batch(3)[0][0][:1, :4]
        out = p.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 12) and torch.equal(out[:, :4], prompt)
    return p


@pytest.mark.parametrize("name,recipe", A2000_CASES, ids=[f"{m}-{r}" for m, r in A2000_CASES])
def test_a2000_flow(name, recipe):
    p = _flow(name, recipe, "a2000")
    rows = {r.name: r for r in dal.prepared(p).report.rows}
    quantized = [r for r in rows.values() if r.status == "quantized"]
    assert any(r.op_class == "linear" for r in quantized)  # the projections are QAT layers
    linears = [m for m in p.modules() if type(m).__name__ in ("QLinear", "QConv1D")]
    assert len(linears) >= 2 * 4  # at least the attention and MLP projections of both layers
    if recipe == "w4a8_fp8_llm":
        fmts = {m.weight_quant.fmt.name for m in linears}
        assert fmts == {"int4", "int8"}  # int4 per group, the lm_head int8 per row
    if name in ROTARY_MODELS:  # the cos / sin tables come from integer positions: no quantizer
        table_ops = [r for r in rows.values() if ".rotary_emb." in r.name and r.op_class in ("mul", "cat")]
        assert table_ops and all(r.status == "float" and "position arithmetic" in r.detail for r in table_ops)
    if name in ("phi", "gpt2"):  # gelu_new, a tanh formula, is one GELU island, not tanh + quantized * and +
        islands = [m for m in p.modules() if type(m).__name__ == "Fp16NewGELUActivation"]
        acts = [n for n, m in p.named_modules() if type(m).__name__ == "Fp16NewGELUActivation"]
        assert len(islands) == 2 and not any(r.startswith(f"{a}.") for a in acts for r in rows)  # no ops inside
    if name in RMSNORM_MODELS:  # every RMSNorm an FP16 island, found by computation
        norms = [m for m in p.modules() if type(m).__name__ == "Fp16RMSNorm"]
        assert len(norms) == 2 * 2 + 1


def _module_paths(model):
    return {n for n, _ in model.named_modules() if n}


@pytest.mark.parametrize("name", list(MODELS))
def test_a1000_passes_or_names_the_layer(name):
    build = MODELS[name][0]
    torch.manual_seed(0)
    paths = _module_paths(build())
    try:
        _flow(name, "int8_balanced", "a1000")
    except RecipeError as err:
        text = str(err)
        offenders = re.findall(r"^\s+- (\S+) \(", text, flags=re.M) or re.findall(r"'a1000': (\S+) \(", text)
        assert offenders, text
        for path in offenders:  # a module path, or a function called in a module's forward
            assert path in paths or path.rpartition(".")[0] in paths, (path, text)
        assert "fix:" in text and "a1000" in text


def test_rmsnorm_on_a1000_refused_by_path_without_a_rule_keeping_it_off():
    """int8_balanced keeps norms in fp16 (off the NPU on the a1000); without that rule each
    RMSNorm is refused by path, with the fix."""
    recipe = dal.recipe.load_recipe("w8a8_llm").to_dict()
    recipe["rules"] = [r for r in recipe["rules"] if "layernorm" not in (r.get("type") or [])]
    recipe["replace"] = ["lut_activation"]
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(_llama(), recipe=recipe, hardware="a1000")
    text = str(err.value)
    for path in ("model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"):
        assert f"{path} (LlamaRMSNorm): an RMSNorm, which hardware 'a1000' cannot run" in text
    assert f"{{match: 'model.norm', skip: true}}" in text and "silu" not in text  # the LUT took the SiLUs


def test_a1000_names_the_gelu_formula_module():
    """Phi's gelu_new (NewGELUActivation, a tanh formula) is refused on the a1000 as one GELU,
    by its module path, with the lookup-table fix (not as a tanh inside it)."""
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(_phi(), recipe="int8_balanced", hardware="a1000")
    text = str(err.value)
    assert "model.layers.0.mlp.activation_fn (NewGELUActivation): the export would hold a float gelu" in text
    assert "lut_activation" in text and "tanh" not in text


def test_a1000_lut_silu_with_w8a8_llm():
    """The SiLU-gated MLP on the int8-only a1000 through the lookup table the recipe asks for."""
    recipe = dal.recipe.load_recipe("w8a8_llm").to_dict()
    recipe["replace"] = ["lut_activation"]
    p = _flow("llama", recipe, "a1000")
    luts = [m for m in p.modules() if type(m).__name__ == "QLutActivation"]
    assert len(luts) == 2 and all(m.fn == "silu" for m in luts)


def test_group_size_that_does_not_divide_names_layer_and_sizes():
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**H, "hidden_size": 48, "intermediate_size": 96},
                                             num_key_value_heads=2))
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(model, recipe="w4a8_fp8_llm", hardware="a2000")
    text = str(err.value)
    assert "model.layers.0.self_attn.q_proj (Linear): in_features 48 is not divisible by the weight group_size 32" \
        in text
    assert "no group size a2000 allows (32, 64, 128) divides 48" in text
    # down_proj reads the MLP's 96 features: 32 divides it, so it is not refused
    assert "model.layers.0.mlp.down_proj" not in text and "lm_head" not in text


def test_example_inputs_quantize_the_residual_adds():
    """transformers decorates its layers' forwards (functools.wraps): the call sites of the
    wrapped code are captured, so each decoder layer's two residual adds are QAdds."""
    p = dal.prepare_qat(_llama(), recipe="int8_balanced", hardware="a2000", example_inputs=_tokens(0)[0])
    rows = dal.prepared(p).report.rows
    for i in range(2):
        adds = [r for r in rows if r.name.startswith(f"model.layers.{i}.dal_sites.add_")]
        assert len(adds) == 2 and all(r.status == "quantized" for r in adds), adds
    dal.calibrate(p, [_tokens(1)[0][0]], progress=False)
    args, kwargs = _tokens(2)
    p(*args, **kwargs).loss.backward()
    assert p.generate(args[0][:1, :4], max_new_tokens=8, do_sample=False, pad_token_id=0).shape == (1, 12)
