"""Decoder graphs of a tiny Llama prepared WITH example_inputs (issue 43): the decoder layer's
residual adds are found by call site (one example forward), so they are quantized adds, and the
o_proj / down_proj linears they read become integer groups in dal.npu (export/SPEC.md §5a).

Oracles: the file's own graph (each residual Add reads two DequantizeLinear and is read only by
quantizers), dal.npu against dal.convert (two integer engines derived independently: identical
bits in every logit and cache code). W4A8 with an INT8 cache (w4a8_int8_llm) and FP8 e4m3
activations and cache (w4a8_fp8_llm: fp8 x int4 linears are float islands, not integer groups);
P = 8, L = 16.
"""
import os
from collections import Counter, defaultdict

os.environ["HF_HUB_OFFLINE"] = "1"

import onnx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402
import dal.npu  # noqa: E402

T = pytest.importorskip("transformers")

# dal.npu's FP16 softmax island casts masked scores (finfo(float32).min) to -inf, as SPEC §5e says
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

P, L, LAYERS, V = 8, 16, 2, 256


def _tokens(seed, n=16, batch=2):
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["w4a8_int8_llm", "w4a8_fp8_llm"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=V,
                                             max_position_embeddings=128))
    p = dal.prepare_qat(model, recipe=request.param, hardware="a2000", example_inputs=(_tokens(0, batch=1),))
    dal.calibrate(p, [_tokens(1), _tokens(2)])
    pre, dec = dal.export_decoder(p, tmp_path_factory.mktemp(request.param) / "llama", prompt_len=P, cache_len=L)
    return request.param, p, pre, dec


def _residual_sites(p):
    """Per layer, the names of the quantized-add call sites prepare found in the decoder layer's forward."""
    sites = [n for n, m in p.named_modules() if ".dal_sites.add" in n and "Add" in type(m).__name__]
    return {i: sorted(n for n in sites if n.startswith(f"model.layers.{i}.")) for i in range(LAYERS)}


def test_residual_adds_quantized_in_the_decode_graph(exported):
    """Two quantized add sites per decoder layer; in the decode file each is an Add of two
    DequantizeLinear (its own input quantizers) read only by quantizers (QuantizeLinear, or the
    next RMSNorm's fp16 input quantizer, a Cast); o_proj's and down_proj's MatMul are read by
    the add's QuantizeLinear, no float Add."""
    _, p, _, dec = exported
    sites = _residual_sites(p)
    assert all(len(s) == 2 for s in sites.values()), sites
    g = onnx.load(dec).graph
    made_by = {o: n for n in g.node for o in n.output}
    readers = defaultdict(list)
    for n in g.node:
        for i in n.input:
            readers[i].append(n)
    for site in (s for layer in sites.values() for s in layer):
        dq = [f"{site}.input_quants.{k}/DequantizeLinear" for k in (0, 1)]
        adds = [n for n in g.node if n.op_type == "Add" and sorted(made_by[i].name for i in n.input) == dq]
        assert len(adds) == 1, site
        outs = readers[adds[0].output[0]]
        assert outs and all(r.op_type == "QuantizeLinear" or r.name.endswith("input_quant/Q/Cast_fp16")
                            for r in outs), [r.name for r in outs]
    for n in g.node:
        if n.op_type == "MatMul" and n.name.endswith(("o_proj/MatMul", "down_proj/MatMul")):
            assert [r.op_type for r in readers[n.output[0]]] == ["QuantizeLinear"], n.name


def test_o_proj_down_proj_integer_groups(exported):
    """INT8 activations: every layer's o_proj and down_proj MatMul is a fused integer group of
    dal.npu (a float Add no longer reads them). FP8 activations: no integer group at all (fp8 x
    int4 linears are float islands)."""
    recipe, _, _, dec = exported
    steps = dal.npu.load(dec).steps
    fused = {s.node_name for s in steps if s.kind == "fused"}
    if recipe == "w4a8_fp8_llm":
        assert not fused and Counter(s.kind for s in steps)["node"] > 0
        return
    for i in range(LAYERS):
        assert {f"/layers.{i}/self_attn/o_proj/MatMul", f"/layers.{i}/mlp/down_proj/MatMul"} <= fused, fused


def test_generate_identical(exported):
    """Greedy decoding: the integer model and dal.npu give the same tokens and the same bits in
    every logit and cache code of the prefill and of each decode step (0 differing elements)."""
    recipe, p, pre, dec = exported
    ids = _tokens(4)
    prompts = [ids[0, :P], ids[1, :5]] if recipe == "w4a8_int8_llm" else [ids[1, :6]]
    report = dal.generate_check(p, (pre, dec), prompts, steps=6)
    assert report.identical and report.differ == 0 and report.elements > 0, str(report)
    assert report.tokens_integer == report.tokens_npu and all(len(t) == 7 for t in report.tokens_npu)
