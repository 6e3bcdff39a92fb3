"""Hugging Face attention made dal's (rule npu_attention, dal/replace/hf_attention.py).

Tiny Llama (grouped-query: 4 heads, 2 kv heads) and GPT-2, hidden 64, 2 layers, vocab 256, built
from config (no download). Oracles: transformers' own sdpa attention on a copy of the float
model, and the same prepared model run without a cache.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import copy  # noqa: E402
import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

T = pytest.importorskip("transformers")

import dal  # noqa: E402
from dal.nn import QMatMul  # noqa: E402
from dal.quantizer import quantizer_states  # noqa: E402
from dal.recipe import load_recipe  # noqa: E402
from dal.replace.hf_attention import DAL_ATTENTION, HfNpuAttention, is_hf_attention  # noqa: E402
from dal.replace.softmax import NpuSoftmax  # noqa: E402

F32_EPS = 2.0 ** -23  # one float32 ulp at 1.0


def npu_recipe(kv=None, replace=("npu_attention",)):
    """int8_balanced with the npu_attention replacement (and a kv_cache rule when ``kv`` is given)."""
    rec = dataclasses.replace(load_recipe("int8_balanced"), replace=tuple(replace))
    return rec.with_rules_prepended([{"type": "kv_cache", "input": kv}]) if kv else rec


def tiny_llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                            max_position_embeddings=128)).eval()


def tiny_gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128,
                                          bos_token_id=0, eos_token_id=0)).eval()


def ids_batch(n=2, length=16, seed=1):
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def models(request):
    """(float copy, prepared + calibrated model, input ids): int8_balanced on the a2000."""
    float_model = tiny_llama() if request.param == "llama" else tiny_gpt2()
    ref = copy.deepcopy(float_model)
    ids = ids_batch()
    p = dal.prepare_qat(float_model, recipe=npu_recipe(), hardware="a2000")
    dal.calibrate(p, [ids, ids_batch(seed=2)])
    p.eval()
    return ref, p, ids


def attentions(model):
    return [(n, m) for n, m in model.named_modules() if is_hf_attention(m)]


def test_each_attention_has_qmatmuls_and_the_hardware_softmax(models):
    ref, p, _ = models
    found = attentions(p)
    assert len(found) == 2 and len(attentions(ref)) == 2
    assert p.config._attn_implementation == DAL_ATTENTION and ref.config._attn_implementation == "sdpa"
    for name, m in found:
        npu = m.npu_attention
        assert isinstance(npu, HfNpuAttention), name
        kinds = [type(c) for c in npu.core.children()]
        assert kinds.count(QMatMul) == 2, (name, kinds)  # Q @ K^T and P @ V on the matrix engine
        assert isinstance(npu.core.softmax, NpuSoftmax) and npu.core.softmax.mode == "fp16"  # a2000: FP16 softmax
        assert all(q.state == "quantize" for mm in (npu.core.matmul, npu.core.matmul_1) for q in mm.input_quants)


def _max_ulps(out, ref):
    """max |out - ref| in float32 ulps of the largest |ref| (the scale every element is summed at)."""
    return float((out.double() - ref.double()).abs().max() / (ref.double().abs().max() * F32_EPS))


def test_float_dal_attention_equals_stock_sdpa(models):
    """Quantizers off: the dal attention is the same arithmetic as transformers' sdpa in another order;
    logits agree to float32 rounding (at most 16 ulps of the largest logit through 2 layers; 2.5 measured)."""
    ref, p, ids = models
    with torch.no_grad():
        want = ref(ids).logits
        with quantizer_states(p, "off"):
            got = p(ids).logits
    assert _max_ulps(got, want) <= 16


def test_padding_mask_matches_stock_and_stays_finite(models):
    """A left-padded batch: the float mask is added to the scores before the softmax; real
    tokens agree with stock sdpa, and padding queries (every key masked) stay finite."""
    ref, p, ids = models
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        with quantizer_states(p, "off"):
            got = p(ids, attention_mask=mask).logits
        quantized = p(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert _max_ulps(got[keep], want[keep]) <= 16
    assert bool(torch.isfinite(quantized).all()) and bool(torch.isfinite(got).all())


def test_training_step(models):
    _, p, ids = models
    p.train()
    try:
        p.zero_grad()
        loss = p(ids, labels=ids).loss
        loss.backward()
    finally:
        p.eval()
    assert bool(torch.isfinite(loss))
    grads = [(n, w.grad) for n, w in p.named_parameters() if w.requires_grad]
    assert all(g is not None and bool(torch.isfinite(g).all()) for _, g in grads)
    # the attention's projections get a gradient through the quantized Q @ K^T / P @ V
    assert any(g.abs().sum() > 0 for n, g in grads if "layers.0" in n or ".h.0." in n)


def greedy_without_cache(model, prompt, steps):
    x = prompt
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], dim=1)
    return x


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_equals_step_by_step_without_cache(models, cache):
    _, p, ids = models
    prompt = ids[:1, :5]
    with torch.no_grad():
        out = p.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         cache_implementation=cache, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + 8
    assert torch.equal(out, greedy_without_cache(p, prompt, 8))


def test_dal_function_falls_back_to_sdpa_without_child():
    """A module the rule did not replace (no npu_attention) gets transformers' sdpa from the dal
    function, on the float mask dal's mask function makes."""
    from dal.replace.hf_attention import register

    register()
    m = tiny_llama()
    ids = ids_batch()
    with torch.no_grad():
        want = m(ids).logits
        m.config._attn_implementation = DAL_ATTENTION
        got = m(ids).logits
    assert _max_ulps(got, want) <= 16


def test_scaling_is_the_calls(models):
    """The call's scaling multiplies the query (modules that scale it themselves, like Whisper's,
    pass 1.0): the same output as the scale applied to the query beforehand, to float32 rounding."""
    _, p, _ = models
    _, m = attentions(p)[0]
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 4, 3, 16, generator=g)  # 4 heads, d 16
    with torch.no_grad(), quantizer_states(p, "off"):
        a, _ = m.npu_attention.attend(m, q, kv, kv, None, scaling=0.3)
        b, _ = m.npu_attention.attend(m, q * 0.3, kv, kv, None, scaling=1.0)
        c, _ = m.npu_attention.attend(m, q, kv, kv, None, scaling=1.0)
    assert _max_ulps(a, b) <= 4 and _max_ulps(a, c) > 1000


def test_refuses_what_it_does_not_model(models):
    _, p, _ = models
    name, m = attentions(p)[0]
    q = kv = torch.randn(1, 4, 3, 16)  # heads 4, head_dim 16 in both models
    with pytest.raises(NotImplementedError, match=f"softcap.*{name}|{name}.*softcap"):
        m.npu_attention.attend(m, q, kv, kv, None, softcap=30.0)
