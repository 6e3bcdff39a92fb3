"""Prefill and decode graphs of a tiny Llama (dal.export_decoder, issue 43 items 1-3) and greedy
decoding with the integer model against dal.npu (dal.generate_check).

Oracles: transformers' own forward (the export wrapper computes the model's function), the KV
quantizer's trained scale (the boundary's DequantizeLinear), dal.npu against dal.convert (two
integer engines derived independently: identical bits), onnxruntime with ORT_DISABLE_ALL layer
by layer (dal.verify). W4A8 with an INT8 cache (w4a8_int8_llm) and with an FP8 e4m3 cache
(w4a8_fp8_llm); P = 8, L = 16.
"""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from onnx import numpy_helper  # noqa: E402

import dal  # noqa: E402
import dal.npu  # noqa: E402
from dal.export import ExportError  # noqa: E402
from dal.export.decoder import MASKED, causal_mask, decoder_step  # noqa: E402
from dal.export.decoder_module import CodesStep, DecoderStep  # noqa: E402

T = pytest.importorskip("transformers")

# dal.npu's FP16 softmax island casts masked scores (finfo(float32).min) to -inf, as SPEC §5e says
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

P, L, LAYERS, KV, D, V = 8, 16, 2, 2, 16, 256
RECIPES = {"int8": ("w4a8_int8_llm", "int8", onnx.TensorProto.INT8),
           "fp8": ("w4a8_fp8_llm", "fp8_e4m3", onnx.TensorProto.FLOAT8E4M3FN)}


def _llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                            num_key_value_heads=KV, intermediate_size=128, vocab_size=V,
                                            max_position_embeddings=128))


def _tokens(seed, n=16, batch=2):
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _prepared(recipe, kv_format):
    rec = dal.load_recipe(recipe)
    if kv_format is None:  # the shipped recipe's own kv_cache rule taken out: a cache without codes
        d = rec.to_dict()
        d["rules"] = [r for r in d["rules"] if "kv_cache" not in str(r.get("type"))]
        rec = dal.load_recipe(d)
    else:
        rec = rec.with_rules_prepended([{"type": "kv_cache", "input": {"format": kv_format,
                                                                       "granularity": "per_tensor",
                                                                       "symmetric": True}}])
    p = dal.prepare_qat(_llama(), recipe=rec, hardware="a2000")
    dal.calibrate(p, [_tokens(1), _tokens(2)])
    return p


@pytest.fixture(scope="module", params=sorted(RECIPES))
def exported(request, tmp_path_factory):
    recipe, kv_format, elem = RECIPES[request.param]
    p = _prepared(recipe, kv_format)
    pre, dec = dal.export_decoder(p, tmp_path_factory.mktemp(request.param) / "llama", prompt_len=P, cache_len=L)
    return request.param, p, pre, dec, elem


def _io(proto):
    def one(v):
        return v.name, v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim]
    return [one(i) for i in proto.graph.input], [one(o) for o in proto.graph.output]


def test_graph_boundary(exported):
    """Static shapes, the names and element types of export/SPEC.md's decoder section; the
    cache's codes carry the KV quantizer's own scale; no int64 compare is left."""
    kind, p, pre, dec, elem = exported
    F, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    kv = [f"{k}_{i}" for i in range(LAYERS) for k in ("key", "value")]
    ins, outs = _io(onnx.load(pre))
    assert ins == [("input_ids", I64, [1, P]), ("position_ids", I64, [1, P]), ("attention_mask", F, [1, 1, P, P])]
    assert outs == [("logits", F, [1, P, V])] + [(f"present_{n}", elem, [1, KV, P, D]) for n in kv]
    proto = onnx.load(dec)
    ins, outs = _io(proto)
    assert ins == [("input_ids", I64, [1, 1]), ("position_ids", I64, [1, 1]), ("attention_mask", F, [1, 1, 1, L + 1])] \
        + [(f"past_{n}", elem, [1, KV, L, D]) for n in kv]
    assert outs == [("logits", F, [1, 1, V])] + [(f"present_{n}", elem, [1, KV, 1, D]) for n in kv]
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    made_by = {o: n for n in proto.graph.node for o in n.output}
    for i in range(LAYERS):
        cache = p.model.layers[i].self_attn.npu_attention.kv_cache
        for role, q in (("key", cache.key_quant), ("value", cache.value_quant)):
            readers = [n for n in proto.graph.node if f"past_{role}_{i}" in n.input]
            assert [n.op_type for n in readers] == ["DequantizeLinear"]
            assert inits[readers[0].input[1]] == np.float32(q.scale.item())
            assert made_by[f"present_{role}_{i}"].op_type == "QuantizeLinear"
            assert inits[made_by[f"present_{role}_{i}"].input[1]] == np.float32(q.scale.item())
    for path in (pre, dec):
        typed = onnx.shape_inference.infer_shapes(onnx.load(path))
        types = {v.name: v.type.tensor_type.elem_type for v in (*typed.graph.value_info, *typed.graph.input)}
        compares = [n for n in typed.graph.node
                    if n.op_type in ("Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal")]
        assert not [n.name for n in compares if any(types.get(x) == I64 for x in n.input)]
        meta = {m.key: m.value for m in onnx.load(path).metadata_props}
        assert (meta["dal.decoder.prompt_len"], meta["dal.decoder.cache_len"]) == (str(P), str(L))


def test_step_computes_the_hf_model():
    """With every quantizer off, the prefill step is transformers' own forward bit for bit, and a
    decode step on the prefill's float cache gives the logits of the whole sequence's forward."""
    p = _prepared("w4a8_int8_llm", "int8")
    ids = _tokens(3, n=6, batch=1)
    n = ids.shape[1]
    with dal.quantizer_states(p, "off"), torch.no_grad():
        p.eval()
        pad = torch.zeros(1, P, dtype=torch.long)
        pad[:, :n] = ids
        out = DecoderStep(p, L, False)(pad, torch.arange(P)[None], causal_mask(torch.arange(P)[None] < n, P, False))
        ref = p(ids).logits
        assert torch.equal(out[0][:, :n], ref)
        past = []
        for t in out[1:]:
            c = torch.zeros(1, KV, L, D)
            c[:, :, :n] = t[:, :, :n]
            past.append(c)
        nxt = torch.tensor([[17]])
        dec = DecoderStep(p, L, True)(nxt, torch.tensor([[n]]), causal_mask(torch.arange(L)[None] < n, 1, True), *past)
        ref = p(torch.cat([ids, nxt], 1)).logits[:, -1:]
        torch.testing.assert_close(dec[0], ref, rtol=0, atol=1e-5)


def test_causal_mask():
    """Additive masks: 0 where attended, finfo(float32).min elsewhere (prefill causal and padded,
    decode: written slots and the new key, last)."""
    m = causal_mask(torch.tensor([[True, True, False]]), 3, False)[0, 0]
    assert (m == 0).tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert set(m.unique().tolist()) == {0.0, MASKED}
    d = causal_mask(torch.tensor([[True, False, False]]), 1, True)[0, 0, 0]
    assert (d == 0).tolist() == [True, False, False, True]


def test_generate_identical(exported):
    """Greedy decoding, 8 steps: the integer model and dal.npu give the same tokens, and the
    same bits in every logit and cache code of the prefill and of each decode step."""
    kind, p, pre, dec, _ = exported
    ids = _tokens(4)
    prompts = [ids[0, :P], ids[1, :5]] if kind == "int8" else [ids[1, :6]]
    report = dal.generate_check(p, (pre, dec), prompts, steps=8)
    assert report.identical and report.differ == 0, str(report)
    per_step = V + 4 * KV * D  # logits + 4 present tensors of one entry
    prefill = P * V + 4 * KV * P * D
    assert report.elements == len(prompts) * (prefill + 8 * per_step)
    assert report.tokens_integer == report.tokens_npu and all(len(t) == 9 for t in report.tokens_npu)


def _random_cache(kind, g):
    """A full cache of random codes (every slot valid): int8 in [-90, 90); float8 e4m3fn: every
    bit pattern but NaN (0x7F, 0xFF), so the whole grid, +-448 included."""
    if kind == "int8":
        return [torch.randint(-90, 90, (1, KV, L, D), generator=g, dtype=torch.int8) for _ in range(2 * LAYERS)]
    out = []
    for _ in range(2 * LAYERS):
        bits = torch.randint(0, 255, (1, KV, L, D), generator=g, dtype=torch.uint8)
        out.append(torch.where(bits == 0x7F, torch.zeros_like(bits), bits).view(torch.float8_e4m3fn))
    return out


def test_verify_onnxruntime(exported):
    """dal.verify_decoder (the prefill, then a decode step fed from the prefill's own cache codes
    and next token) and dal.verify on the decode graph with a full cache of random codes, for the
    INT8 and the FP8 e4m3 cache (float8 feeds reach onnxruntime as OrtValues): integer model ==
    NPU on every element (logits and cache codes), onnxruntime (optimizations off) and torch
    within the near-tie rule layer by layer, the KV cache quantizers' rows among them."""
    pytest.importorskip("onnxruntime")
    kind, p, pre, dec, _ = exported
    report = dal.verify_decoder((pre, dec), p, _tokens(5)[0, :6])
    assert report.verdict(), str(report)
    assert (report.prompt_len, report.position) == (6, 6)
    text = str(report)
    assert text.index("PREFILL") < text.index("DECODE (cache from the prefill)")
    assert text.count("VERDICT: PASS") == 3  # the decoder's verdict and each section's
    doc = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert doc["verdict"] is True and doc["decode"]["verdict_line"] == report.decode.verdict_line()
    g = torch.Generator().manual_seed(5)
    full = (torch.tensor([[7]]), torch.tensor([[L - 1]]), causal_mask(torch.ones(1, L, dtype=torch.bool), 1, True),
            *_random_cache(kind, g))
    for r in (report.prefill, report.decode, dal.verify(dec, decoder_step(p, dec), full)):
        assert r.integer.identical and r.integer.elements > 0, str(r.integer)
        # every quantizer's codes (int8 and float8) compared with the integer model's, not only the outputs
        assert r.integer.tensors == sum(not row.tensor.startswith("present_") for row in r.layers_forced) > 20
        assert r.verdict(), str(r)
        assert r.layers_forced and all(row.max_abs <= 1 for row in r.layers_forced)
        assert all(row.max_abs <= 1 for row in r.torch_layers)
        # the cache layer by layer: the prefill's present outputs, the decode's cache quantizers (and its
        # present entries); each cache quantizer's row carries its cosine against the float model
        cache_rows = [row for row in r.layers_forced if row.tensor.startswith("present_") or ".kv_cache." in row.tensor]
        assert sum(row.float_cosine is not None and row.float_cosine > 0.9 for row in cache_rows) == 2 * LAYERS
        assert set(r.outputs) == {"logits"} | {f"present_{k}_{i}" for i in range(LAYERS) for k in ("key", "value")}
        # cache outputs are codes: compared in codes (int8 LSBs, float8 grid steps), not in an activation's scale
        assert all(r.outputs[n]["npu_vs_ort"].lsb == 1.0 and r.outputs[n]["npu_vs_torch"].lsb == 1.0
                   for n in r.outputs if n != "logits")


def test_wrong_cache_scale_caught(exported, tmp_path):
    """A decode file whose past_key_0 DequantizeLinear carries a scale 1% off the trained one
    (what a file exported one QAT step early would hold): integer model vs NPU differ at the
    first decode step, not at the prefill; dal.verify_decoder's one verdict fails, at the decode."""
    kind, p, pre, dec, _ = exported
    if kind != "int8":
        pytest.skip("the NPU reads the boundary DequantizeLinear's scale from the file, the integer model "
                    "the trained one, whatever the codes' element type: the int8 case proves the catch")
    proto = onnx.load(dec)
    node = next(n for n in proto.graph.node if "past_key_0" in n.input)
    init = next(t for t in proto.graph.initializer if t.name == node.input[1])
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.01), init.name))
    bad = tmp_path / "bad.decode.onnx"
    onnx.save(proto, bad)
    report = dal.generate_check(p, (pre, bad), [_tokens(4)[0, :P]], steps=2)
    assert report.first is not None and report.first.step == 1 and report.differ > 0, str(report)
    both = dal.verify_decoder((pre, bad), p, _tokens(4)[0, :6], onnxruntime=False)
    assert both.prefill.verdict() and not both.decode.integer.identical and not both.verdict(), str(both)
    line = both.verdict_line()  # torch vs NPU layer by layer: the cache quantizer reading past_key_0 is named
    assert line.startswith("DECODER VERDICT: FAIL (prefill PASS, decode FAIL); first at fault: decode: "), line
    assert "model.layers.0.self_attn.npu_attention.kv_cache.key_quant" in line, line


def test_bad_inputs(exported):
    """A prompt longer than P, a cache one slot short or of the wrong element type (uint8 for
    int8; float8 e5m2 for e4m3): named errors from generate_check, dal.npu, the integer model's
    step, dal.verify and dal.verify_decoder."""
    kind, p, pre, dec, _ = exported
    if kind == "int8":  # the prompt checks read the files' metadata only: one recipe proves them
        with pytest.raises(ValueError, match=r"prompt 1 has 9 tokens.*1 \.\. 8"):
            dal.generate_check(p, (pre, dec), [_tokens(4)[0, :3], _tokens(4)[0, :9]], steps=1)
        with pytest.raises(ValueError, match=r"prompt 0 \(8 tokens\) \+ 9 steps exceeds.*16"):
            dal.generate_check(p, (pre, dec), [_tokens(4)[0, :8]], steps=9)
        with pytest.raises(dal.verification.VerifyInputError, match=r"prompt has 9 tokens.*1 \.\. 8"):
            dal.verify_decoder((pre, dec), p, _tokens(4)[0, :9])
        with pytest.raises(dal.verification.VerifyInputError, match=r"decode\.onnx is a decode graph.*position 0"):
            dal.verify_decoder((dec, pre), p, _tokens(4)[0, :3])
        with pytest.raises(dal.verification.VerifyInputError, match=r"dal\.verify_decoder"):
            dal.verify((pre, dec), p, ())
    codes, wrong = ((np.int8, torch.int8), (np.uint8, torch.uint8)) if kind == "int8" else \
        ((ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn), (ml_dtypes.float8_e5m2, torch.float8_e5m2))
    names = [i.name for i in onnx.load(dec).graph.input]
    good = [np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), np.zeros((1, 1, 1, L + 1), np.float32)] \
        + [np.zeros((1, KV, L, D), codes[0])] * (2 * LAYERS)
    want = np.dtype(codes[0]).name
    sess = dal.npu.load(dec)
    for bad, match in ((np.zeros((1, KV, L - 1, D), codes[0]), r"past_key_0.*shape \[1, 2, 16, 16\]"),
                       (np.zeros((1, KV, L, D), wrong[0]), rf"past_key_0.*{want}, got {np.dtype(wrong[0]).name}")):
        with pytest.raises(dal.npu.NPUError, match=match):
            sess.run(dict(zip(names, good[:3] + [bad] + good[4:])))
    step = CodesStep(DecoderStep(p, L, True))
    base = [torch.from_numpy(a) for a in good[:3]] + [torch.zeros(1, KV, L, D, dtype=codes[1])] * (2 * LAYERS)
    with pytest.raises(ValueError, match=r"past_value_1 must be \[B, kv_heads, 16, head_dim\]"):
        step(*base[:-1], torch.zeros(1, KV, L + 1, D, dtype=codes[1]))
    fmt = "int8" if kind == "int8" else "fp8_e4m3"
    with pytest.raises(ValueError, match=rf"past_key_0 must hold {fmt} codes.*got torch\.{np.dtype(wrong[0]).name}"):
        step(*base[:3], torch.zeros(1, KV, L, D, dtype=wrong[1]), *base[4:])
    with pytest.raises(dal.verification.VerifyInputError,
                       match=rf"input 3 \('past_key_0'\) is {np.dtype(wrong[0]).name}, but .*takes {want}"):
        dal.verify(dec, decoder_step(p, dec), (*base[:3], torch.zeros(1, KV, L, D, dtype=wrong[1]), *base[4:]))


def test_export_needs_a_quantized_cache(tmp_path):
    """Without a kv_cache rule the cache has no codes to cross the boundary: refused, every layer named."""
    p = _prepared("w4a8_int8_llm", None)
    with pytest.raises(ExportError, match=r"layers\.0\.self_attn.*key_quant \(none\).*layers\.1\.self_attn"):
        dal.export_decoder(p, tmp_path / "x", prompt_len=P, cache_len=L)


def test_qwen2_per_head_cache(tmp_path):
    """A tiny Qwen2 (biased q/k/v projections) with one INT8 cache scale per KV head: the boundary's
    DequantizeLinear carries the quantizer's per-head scales on axis 1, and 4 greedy steps are
    identical on the integer model and dal.npu."""
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                             num_key_value_heads=KV, intermediate_size=128, vocab_size=V,
                                             max_position_embeddings=128))
    rec = dal.load_recipe("w4a8_int8_llm").with_rules_prepended(
        [{"type": "kv_cache", "input": {"format": "int8", "granularity": "per_channel", "symmetric": True}}])
    p = dal.prepare_qat(model, recipe=rec, hardware="a2000")
    dal.calibrate(p, [_tokens(1), _tokens(2)])
    pre, dec = dal.export_decoder(p, tmp_path / "qwen2", prompt_len=P, cache_len=L)
    proto = onnx.load(dec)
    node = next(n for n in proto.graph.node if "past_value_1" in n.input)
    scale = next(numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == node.input[1])
    q = p.model.layers[1].self_attn.npu_attention.kv_cache.value_quant
    assert np.array_equal(scale, q.scale.detach().float().numpy()) and scale.shape == (KV,)
    assert [a.i for a in node.attribute if a.name == "axis"] == [1]
    report = dal.generate_check(p, (pre, dec), [_tokens(6)[0, :7]], steps=4)
    assert report.identical, str(report)


def test_decoder_step_needs_a_decoder_file(exported, tmp_path):
    """decoder_step reads the file's dal.decoder.* metadata: a file without it is named."""
    kind, p, pre, dec, _ = exported
    if kind != "int8":
        pytest.skip("decoder_step reads the files' metadata only, the same for every cache format: int8 proves it")
    assert decoder_step(p, pre).step.decode is False and decoder_step(p, dec).step.decode is True
    proto = onnx.load(pre)
    del proto.metadata_props[:]
    onnx.save(proto, tmp_path / "plain.onnx")
    with pytest.raises(ExportError, match=r"plain\.onnx has no dal\.decoder"):
        decoder_step(p, tmp_path / "plain.onnx")


def test_blocked_linears_with_a_float_output(exported):
    """export/SPEC.md §5a's blocked linear with a float output. INT8 activations: every INT4 linear
    but `up_proj` (a blocked integer group) is one: `q/k/v_proj` (read by Reshape), `gate_proj` (the
    FP16 SiLU island), `o_proj` / `down_proj` (the float residual Add), in dal.npu's decode and
    prefill files alike and in the integer model's layer forms (`lm_head`, int8 per channel in this
    recipe, stays a float island); each one's float output in the decode file equals the SPEC
    formula written with Python integers (tests/blocked_oracle.py) on the file's own codes.
    FP8 activations: none (the form takes integer input codes)."""
    import blocked_oracle
    from dal.convert import convert
    from dal.convert.blocked_linear import BLOCKED_FLOAT

    kind, p, pre, dec, _ = exported
    lin = [f"layers.{i}.{m}" for i in range(LAYERS)
           for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.down_proj")]
    node = {n: "/" + n.replace(".", "/").replace("layers/", "layers.") + "/MatMul" for n in lin}
    for path in (pre, dec):
        steps = dal.npu.load(path, threads=1).steps
        floats = {s.node_name for s in steps if s.kind == "blocked_float"}
        fused = {s.node_name for s in steps if s.kind == "fused"}
        if kind == "fp8":
            assert not floats and not fused
            continue
        assert floats == set(node.values()), floats
        assert fused == {f"/layers.{i}/mlp/up_proj/MatMul" for i in range(LAYERS)}, fused
    if kind == "fp8":
        return
    im = convert(decoder_step(p, dec))
    g = torch.Generator().manual_seed(3)
    feed = (torch.tensor([[5]]), torch.tensor([[L - 1]]), causal_mask(torch.ones(1, L, dtype=torch.bool), 1, True),
            *_random_cache(kind, g))
    with torch.no_grad():
        im(*feed)
    forms = {k.split("model.", 1)[-1]: f for k, f in im.layer_forms().items()}
    assert {k for k, f in forms.items() if f == BLOCKED_FLOAT} == set(lin), forms
    assert [f for k, f in forms.items() if k.endswith("lm_head")][0].startswith("float"), forms
    proto = onnx.load(dec)
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    by_name = {n.name: n for n in proto.graph.node}
    made = {o: n for n in proto.graph.node for o in n.output}
    _, vals = dal.npu.load(dec, threads=1).run([t.numpy() for t in feed], return_intermediates=True)
    for name in node.values():
        mm = by_name[name]
        xdq, wdq = made[mm.input[0]], made[mm.input[1]]
        wq = inits[wdq.input[0]]
        block = next(a.i for a in wdq.attribute if a.name == "block_size")
        wz = inits[wdq.input[2]] if len(wdq.input) > 2 else np.zeros(inits[wdq.input[1]].shape, wq.dtype)
        xq = vals[xdq.input[0]].reshape(-1, wq.shape[0])
        want = blocked_oracle.block_values(xq, int(inits[xdq.input[2]]), wq, wz, inits[wdq.input[1]], block,
                                           inits[xdq.input[1]])
        np.testing.assert_array_equal(vals[mm.output[0]].reshape(want.shape), want, err_msg=name)
