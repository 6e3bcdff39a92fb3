"""KV-cache quantizers (dal/nn/kv_cache.py): a recipe rule ``type: kv_cache``; codes against a
float64 model of the formula, INT8 (round half even, zero point, clamp) and FP8 (ml_dtypes
float8_e4m3fn casts); per-head scales; codes of cached entries across decode steps; the report;
the a1000; refusals naming the hardware.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

T = pytest.importorskip("transformers")

import dal  # noqa: E402
from dal.hardware import load_hardware  # noqa: E402
from dal.nn.kv_cache import QKVCache  # noqa: E402
from dal.recipe.errors import RecipeError  # noqa: E402

from test_hf_attention import ids_batch, npu_recipe, tiny_llama  # noqa: E402

INT8_HEAD = {"format": "int8", "granularity": "per_channel", "symmetric": False, "observer": "minmax"}
FP8 = {"format": "fp8_e4m3", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"}
REL = 2.0 ** -23  # float32 division is correctly rounded: |fl(x / s) - x / s| <= 2^-24 |x / s|


def prepared(kv, hardware="a2000", calibrate=True):
    # the a1000 runs SiLU through its lookup table only (lut_activation)
    replace = ("npu_attention",) + (("lut_activation",) if hardware == "a1000" else ())
    p = dal.prepare_qat(tiny_llama(), recipe=npu_recipe(kv, replace), hardware=hardware)
    if calibrate:
        dal.calibrate(p, [ids_batch(seed=3), ids_batch(seed=4)])
    return p.eval()


def caches(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QKVCache)]


def record(model, run):
    """``{quantizer name: [(input, output), ...]}`` of every KV quantizer over ``run()``."""
    seen, hooks = {}, []
    for _, c in caches(model):
        for q in c.quantizers().values():
            hooks.append(q.register_forward_hook(
                lambda m, i, o: seen.setdefault(m.name, []).append((i[0].detach().clone(), o.detach().clone()))))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def broadcast(t, x, axis):
    if t.numel() == 1:
        return t.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.reshape(shape)


@pytest.fixture(scope="module")
def int8_model():
    return prepared(INT8_HEAD)


@pytest.fixture(scope="module")
def fp8_model():
    return prepared(FP8)


def test_int8_codes_equal_a_float64_model(int8_model):
    """code = clamp(round_half_even(x / s) + zp, -128, 127), one (s, zp) per kv head; the output is
    float32((code - zp) * s). A code may differ only by one, where x / s lies within float32's
    rounding of the division of a .5 boundary (a near-tie)."""
    seen = record(int8_model, lambda: int8_model(ids_batch(seed=5)))
    assert len(seen) == 4  # key and value of 2 layers
    checked = 0
    for name, calls in seen.items():
        q = dict(int8_model.named_modules())[name]
        for x, y in calls:
            s = broadcast(q.scale.double(), x, 1)
            zp = broadcast(q.zero_point.double(), x, 1)
            r = x.double() / s
            want = torch.clamp(torch.round(r) + zp, -128, 127)  # torch.round: half to even
            got = torch.round(y.double() / s) + zp
            assert bool(((got >= -128) & (got <= 127)).all())
            differ = got != want
            near_tie = ((r - torch.floor(r) - 0.5).abs() <= REL * r.abs()) & ((got - want).abs() == 1)
            assert bool((~differ | near_tie).all()), name
            same = ~differ
            assert torch.equal(y[same], ((want - zp) * s).float().expand_as(y)[same])
            checked += x.numel()
    assert checked > 0


def test_fp8_codes_equal_ml_dtypes(fp8_model):
    """FP8 e4m3: float8_e4m3fn(x / s) saturated to +-448 (ONNX saturate=1), times s. ml_dtypes casts
    the float64 quotient once; a value may differ only as the neighbouring fp8 value where x / s is
    within float32 division rounding of the midpoint of the two."""
    seen = record(fp8_model, lambda: fp8_model(ids_batch(seed=6)))
    assert len(seen) == 4
    for name, calls in seen.items():
        q = dict(fp8_model.named_modules())[name]
        assert q.scale.numel() == 1
        s = float(q.scale.double())
        for x, y in calls:
            r = x.double().numpy() / s
            want = np.clip(r, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            got = y.double().numpy() / s
            got8 = got.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            assert np.all(np.abs(got - got8) <= np.abs(got8) * REL)  # the output is s times an fp8 value
            differ = got8 != want
            mid = (got8 + want) / 2
            assert np.all(~differ | (np.abs(r - mid) <= np.abs(r) * REL)), name
            same = ~differ
            assert np.array_equal(y.numpy()[same], (want * s).astype(np.float32)[same])
        assert np.abs(np.concatenate([c[0].numpy().ravel() for c in calls])).max() > 0


def test_per_head_scales(int8_model):
    for name, c in caches(int8_model):
        for q in (c.key_quant, c.value_quant):
            assert q.scale.shape == (2,) and q.zero_point.shape == (2,), name  # 2 kv heads
            assert q.granularity.axis == 1


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_codes_do_not_change_across_decode_steps(int8_model, cache):
    """The attention function sees past + new entries at every step; with the static scale each
    entry's code is the one it got when it entered the cache, and quantizing again is the identity."""
    prompt = ids_batch(1, 5, seed=7)
    seen = record(int8_model, lambda: int8_model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
        cache_implementation=cache, pad_token_id=0))
    for name, calls in seen.items():
        q = dict(int8_model.named_modules())[name]
        assert len(calls) == 6  # the prefill and 5 decode steps
        for step in range(1, len(calls)):
            before, now = calls[step - 1][1], calls[step][1]
            filled = prompt.shape[1] + step - 1  # entries in the cache before this step
            assert torch.equal(now[:, :, :filled], before[:, :, :filled]), (name, step)
        with torch.no_grad():
            for _, y in calls:
                assert torch.equal(q(y), y)


def test_report_lists_cache_quantizers(int8_model):
    rep = dal.prepared(int8_model).report
    rows = [r for r in rep.rows if r.name.endswith("npu_attention.kv_cache")]
    assert [r.name for r in rows] == [f"model.layers.{i}.self_attn.npu_attention.kv_cache" for i in range(2)]
    assert all(r.status == "quantized" and "key=int8" in r.detail and "value=int8" in r.detail for r in rows)
    notes = [n for n in rep.notes if "KV cache quantizers" in n]
    assert len(notes) == 2 and all("int8 per head" in n for n in notes)
    assert "npu_attention.kv_cache" in str(rep)


def test_dal_report_lists_cache_quantizers(int8_model, tmp_path):
    pytest.importorskip("matplotlib")
    path = dal.report(int8_model, out=tmp_path / "r.html", sensitivity=False, progress=False, max_histograms=0)
    text = path.read_text()
    for i in range(2):
        assert f"model.layers.{i}.self_attn.npu_attention.kv_cache" in text
    assert text.count("KV cache quantizers key_quant, value_quant int8 per head") == 2


def test_no_kv_rule_no_kv_quantizers():
    p = dal.prepare_qat(tiny_llama(), recipe=npu_recipe(), hardware="a2000")
    assert all(not c.quantizers() for _, c in caches(p)) and len(caches(p)) == 2


def test_checkpoint_restores_kv_scales(int8_model):
    fresh = prepared(INT8_HEAD, calibrate=False)
    fresh.load_state_dict(int8_model.state_dict())
    for (_, a), (_, b) in zip(caches(fresh), caches(int8_model)):
        assert torch.equal(a.key_quant.scale, b.key_quant.scale) and a.key_quant.state == b.key_quant.state


def test_a1000_int8_kv_cache():
    p = prepared({**INT8_HEAD, "granularity": "per_tensor"}, hardware="a1000")
    (name, c), _ = caches(p)
    assert c.key_quant.fmt.name == "int8" and c.key_quant.scale.numel() == 1
    assert p.get_submodule(name.rsplit(".", 1)[0]).core.softmax.mode == "lut"  # the a1000's table softmax
    ids = ids_batch(seed=8)
    pad = torch.ones_like(ids)
    pad[0, :5] = 0  # left padding: those queries see no key (the table softmax would give 0 / 0)
    with torch.no_grad():
        assert bool(torch.isfinite(p(ids).logits).all())
        assert bool(torch.isfinite(p(ids, attention_mask=pad).logits).all())


PROBS = {"type": "softmax", "match": "*.npu_attention.core.softmax",
         "output": {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}


def test_attention_probabilities_quantized_as_an_option_on_a1000():
    """Off by default (the softmax rule of int8_balanced is fallback: fp16); a rule with an output
    spec for the attention softmax quantizes P where the a1000's table softmax writes it (uint8):
    P = float32((clamp(round_half_even(p / s) + zp, 0, 255) - zp) * s), near-ties excepted."""
    plain = prepared(None, hardware="a1000", calibrate=False)
    assert all(layer.self_attn.npu_attention.core.softmax.output_quant is None for layer in plain.model.layers)
    rec = npu_recipe(None, ("npu_attention", "lut_activation")).with_rules_prepended([PROBS])
    p = dal.prepare_qat(tiny_llama(), recipe=rec, hardware="a1000")
    dal.calibrate(p, [ids_batch(seed=3)])
    p.eval()
    sm = p.model.layers[0].self_attn.npu_attention.core.softmax
    q = sm.output_quant
    assert q is not None and q.fmt.name == "uint8" and sm.mode == "lut"
    assert any("attention probabilities quantized to uint8" in n for n in dal.prepared(p).report.notes)
    seen = []
    h = q.register_forward_hook(lambda m, i, o: seen.append((i[0].detach(), o.detach())))
    try:
        with torch.no_grad():
            p(ids_batch(seed=9))
    finally:
        h.remove()
    (x, y), = seen
    s, zp = q.scale.double(), q.zero_point.double()
    r = x.double() / s
    want = torch.clamp(torch.round(r) + zp, 0, 255)
    differ = want != torch.round(y.double() / s) + zp
    assert bool((~differ | ((r - torch.floor(r) - 0.5).abs() <= REL * r.abs())).all())
    assert torch.equal(y[~differ], ((want - zp) * s).float()[~differ])


def test_uint8_probabilities_refused_on_a2000():
    """The a2000's softmax writes fp16 only."""
    with pytest.raises(RecipeError, match=r"core\.softmax: attention probabilities in uint8 .*'a2000'.*fp16"):
        dal.prepare_qat(tiny_llama(), recipe=npu_recipe().with_rules_prepended([PROBS]), hardware="a2000")


def test_fp8_kv_refused_on_a1000_names_the_hardware():
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(tiny_llama(), recipe=npu_recipe(FP8, ("npu_attention", "lut_activation")), hardware="a1000")
    text = str(err.value)
    assert "a1000" in text and "fp8_e4m3" in text and "model.layers.0.self_attn.npu_attention.kv_cache" in text
    assert "int8, uint8" in text  # what it would allow


def test_kv_rule_refused_on_hardware_without_kv_cache():
    hw = load_hardware("pow2_int8")
    assert hw.op("kv_cache") is None
    with pytest.raises(RecipeError, match=r"pow2_int8.*has no kv_cache op"):
        dal.prepare_qat(tiny_llama(), recipe=npu_recipe({**INT8_HEAD, "granularity": "per_tensor"}),
                        hardware=hw)


def test_recipe_check_takes_per_head_kv_scales():
    """The recipe check reads the kv_cache op's own granularities; other activations keep the
    hardware's activation_rules (per tensor only)."""
    from dal.recipe import check_against_hardware

    check_against_hardware(npu_recipe(INT8_HEAD), "a2000")
    per_channel_matmul = npu_recipe().with_rules_prepended([{"type": "matmul", "input": INT8_HEAD}])
    with pytest.raises(RecipeError, match="activation granularity per_channel is not supported"):
        check_against_hardware(per_channel_matmul, "a2000")
    with pytest.raises(RecipeError, match=r"per_group is not supported \(allowed: per_tensor, per_channel\)"):
        dal.prepare_qat(tiny_llama(), recipe=npu_recipe({**INT8_HEAD, "granularity": "per_group", "group_size": 8,
                                                         "axis": 3}), hardware="a2000")


def test_hardware_schema_granularities():
    a2000 = load_hardware("a2000")
    assert a2000.activation_granularities("kv_cache") == ("per_tensor", "per_channel")
    assert a2000.activation_granularities("matmul") == ("per_tensor",)  # the activation_rules
    d = a2000.to_dict()
    d["ops"]["kv_cache"]["granularities"] = ["per_head"]
    with pytest.raises(ValueError, match="per_head"):
        load_hardware(d)
