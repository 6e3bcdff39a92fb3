"""dal/convert/compiled.py ``compile_blocks``: a tiny Llama's decode step with its decoder layers
captured by torch.compile(backend="eager") gives, over 64 greedy decode steps, every logit and every
KV-cache code of the eager integer model and of dal.npu running the exported decode file, bit for bit.

Oracle: dal.npu (the independent C++ / numpy NPU reference reading only the ONNX file) and the eager
integer model; the captured graph is checked to run (the quantizers' eager route is not called).
"""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402
import dal.npu  # noqa: E402
from dal.convert import ConvertError, convert  # noqa: E402
from dal.convert.compiled import compile_blocks  # noqa: E402
from dal.convert.quant_calls import IntegerQuantizer  # noqa: E402
from dal.export.decoder import causal_mask  # noqa: E402
from dal.export.decoder_module import CodesStep, DecoderStep  # noqa: E402

T = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

P, L, V, STEPS = 8, 72, 256, 64


def _tokens(seed, n=16):
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=128, vocab_size=V,
                                             max_position_embeddings=128))
    rec = dal.load_recipe("w4a8_int8_llm").with_rules_prepended(
        [{"type": "kv_cache", "input": {"format": "int8", "granularity": "per_tensor", "symmetric": True}}])
    p = dal.prepare_qat(model, recipe=rec, hardware="a2000")
    dal.calibrate(p, [_tokens(1), _tokens(2)])
    pre, dec = dal.export_decoder(p, tmp_path_factory.mktemp("llama") / "llama", prompt_len=P, cache_len=L)
    return p, pre, dec


def _prefill(p, prompt):
    int_pre = convert(CodesStep(DecoderStep(p, L, False)))
    ids = torch.zeros(1, P, dtype=torch.long)
    ids[0, :prompt.numel()] = prompt
    with torch.no_grad():
        out = int_pre(ids, torch.arange(P)[None], causal_mask(torch.arange(P)[None] < prompt.numel(), P, False))
    caches = []
    for t in out[1:]:
        c = torch.zeros(*t.shape[:2], L, t.shape[3], dtype=t.dtype)
        c[:, :, :P] = t
        caches.append(c)
    return int(out[0][0, prompt.numel() - 1].argmax()), caches


def _decode_models(p, dec):
    """Two integer models of the decode step (one to stay eager, one to capture), dal.npu on the
    decode file, and the file's input names."""
    import onnx

    names = [i.name for i in onnx.load(str(dec)).graph.input]
    return (convert(CodesStep(DecoderStep(p, L, True))), convert(CodesStep(DecoderStep(p, L, True))),
            dal.npu.load(dec, threads=1), names)


def _decode_inputs(tok, pos, caches):
    """A decode step's inputs: the token, its position, the causal mask over the cache, the cache."""
    return (torch.tensor([[tok]]), torch.tensor([[pos]]), causal_mask(torch.arange(L)[None] < pos, 1, True), *caches)


def test_captured_layers_equal_eager_and_npu_for_64_decode_steps(tiny, monkeypatch):
    p, _, dec = tiny
    prompt = _tokens(4)[0, :5]
    tok, caches = _prefill(p, prompt)
    eager, captured, npu, names = _decode_models(p, dec)
    with torch.no_grad():
        with pytest.raises(ConvertError, match="run the integer model once"):
            compile_blocks(captured, "step.lm.model.layers")
        captured(*_decode_inputs(tok, prompt.numel(), caches))  # the probe forward
        assert compile_blocks(captured, "step.lm.model.layers") == 2
        calls = []
        direct = IntegerQuantizer._direct
        monkeypatch.setattr(IntegerQuantizer, "_direct", lambda self, x: calls.append(1) or direct(self, x))
        n_elements = 0
        for step in range(STEPS):
            pos = prompt.numel() + step
            x = _decode_inputs(tok, pos, caches)
            calls.clear()
            want = eager(*x)
            n_eager = len(calls)
            calls.clear()
            got = captured(*x)
            if step:  # after the first captured call (the capture itself): the graph ran, not the quantizers
                assert len(calls) < n_eager // 3, (len(calls), n_eager)
            ref = npu.run(dict(zip(names, [t.numpy() for t in x])))
            assert len(got) == len(want) == len(ref) == 5
            for a, b, c in zip(got, want, ref):
                assert torch.equal(a, b)
                assert np.array_equal(a.numpy(), np.asarray(c))
                n_elements += a.numel()
            tok = int(got[0][0, 0].argmax())
            for k in range(4):
                caches[k][:, :, pos:pos + 1] = got[k + 1]
    assert n_elements == STEPS * (V + 4 * 2 * 16)


def test_run_with_codes_and_bad_blocks_on_a_captured_model(tiny):
    p, _, _ = tiny
    prompt = _tokens(5)[1, :6]
    tok, caches = _prefill(p, prompt)
    x = (torch.tensor([[tok]]), torch.tensor([[6]]), causal_mask(torch.arange(L)[None] < 6, 1, True), *caches)
    m = convert(CodesStep(DecoderStep(p, L, True)))
    with torch.no_grad():
        want = m(*x)
        want_out, want_codes = m.run_with_codes(*x)
        with pytest.raises(ConvertError, match="not a submodule"):
            compile_blocks(m, [torch.nn.Linear(2, 2)])
        with pytest.raises(ConvertError, match="no submodule"):
            compile_blocks(m, "step.lm.model.no_such_layers")
        compile_blocks(m, list(m.net.get_submodule("step.lm.model.layers")))
        got = m(*x)
        out, codes = m.run_with_codes(*x)  # taps: the blocks run eagerly
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(out, want_out))
    assert codes.keys() == want_codes.keys()
    assert all(torch.equal(a, b) for k in codes for a, b in zip(codes[k], want_codes[k]))


def test_a_new_input_shape_captures_again(tiny):
    """Guards are kept on the blocks' tensor arguments: a prefill step captured at 8 positions and then
    called with 5 gets a graph of its own and the eager model's values (a graph reused for the wrong
    shape would fail or differ)."""
    p, _, _ = tiny
    eager = convert(CodesStep(DecoderStep(p, L, False)))
    captured = convert(CodesStep(DecoderStep(p, L, False)))
    ids = _tokens(6)[:1, :P]

    def inputs(n):
        return ids[:, :n], torch.arange(n)[None], causal_mask(torch.ones(1, n, dtype=torch.bool), n, False)
    with torch.no_grad():
        captured(*inputs(P))
        captured.compile_blocks("step.lm.model.layers")
        for n in (P, 5, P):
            want, got = eager(*inputs(n)), captured(*inputs(n))
            assert got[0].shape == (1, n, V)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_whole_step_captured_equals_eager_and_npu(tiny, monkeypatch):
    """``compile_blocks(m, "step")``: the whole DecoderStep (embedding, layers, final norm, ``lm_head``'s
    numpy float64 matmul as the ``dal_convert::matmul_f64`` operator, the KV quantizers' hooks kept
    instead of registered per call) as one graph: 16 greedy decode steps equal the eager integer model
    and dal.npu on every logit and KV code; after the capture neither the eager matmul route nor the
    quantizers' eager route runs; the prepared model gets no hook; a prefill step captured whole gives
    the eager values at a new prompt length too, and so does one whose whole net (``""``: the codes
    boundary too) is captured."""
    import dal.convert.matmul_f64 as mm
    p, _, dec = tiny
    hooks_before = [len(m._forward_hooks) for m in p.modules()]
    prompt = _tokens(7)[0, :4]
    tok, caches = _prefill(p, prompt)
    eager, captured, npu, names = _decode_models(p, dec)
    calls = []
    direct, kn, kn_of = IntegerQuantizer._direct, mm.weight_kn, mm.weight_kn_of
    with torch.no_grad():
        captured(*_decode_inputs(tok, prompt.numel(), caches))  # the probe forward
        assert compile_blocks(captured, "step") == 1
        monkeypatch.setattr(IntegerQuantizer, "_direct", lambda self, x: calls.append("q") or direct(self, x))
        monkeypatch.setattr(mm, "weight_kn", lambda *a: calls.append("eager mm") or kn(*a))
        monkeypatch.setattr(mm, "weight_kn_of", lambda *a: calls.append("op mm") or kn_of(*a))
        for step in range(16):
            pos = prompt.numel() + step
            x = _decode_inputs(tok, pos, caches)
            want = eager(*x)
            calls.clear()
            got = captured(*x)
            if step:
                assert calls.count("q") == 0 and calls.count("eager mm") == 0 and calls.count("op mm") == 1, calls
            ref = npu.run(dict(zip(names, [t.numpy() for t in x])))
            assert len(got) == len(want) == len(ref) == 5
            for a, b, c in zip(got, want, ref):
                assert torch.equal(a, b)
                assert np.array_equal(a.numpy(), np.asarray(c))
            tok = int(got[0][0, 0].argmax())
            for k in range(4):
                caches[k][:, :, pos:pos + 1] = got[k + 1]
        pre_eager = convert(CodesStep(DecoderStep(p, L, False)))
        pre = convert(CodesStep(DecoderStep(p, L, False)))
        ids = _tokens(8)[:1, :P]

        def pre_inputs(n):
            return ids[:, :n], torch.arange(n)[None], causal_mask(torch.ones(1, n, dtype=torch.bool), n, False)
        pre(*pre_inputs(P))
        pre.compile_blocks("")  # the whole net: the codes boundary in the graph too
        for n in (P, 5):
            assert all(torch.equal(a, b) for a, b in zip(pre(*pre_inputs(n)), pre_eager(*pre_inputs(n))))
    assert [len(m._forward_hooks) for m in p.modules()] == hooks_before


def test_a_captured_net_names_a_bad_cache_as_the_eager_model_does(tiny):
    """Bad input reaches the decode step's own check through a captured whole net (its Python checks are
    traced and raise when a new shape or dtype is traced): a cache one entry short, a cache of floats."""
    p, _, dec = tiny
    prompt = _tokens(7)[0, :4]
    tok, caches = _prefill(p, prompt)
    eager, captured, _, _ = _decode_models(p, dec)
    with torch.no_grad():
        captured(*_decode_inputs(tok, prompt.numel(), caches))  # the probe forward
        captured.compile_blocks("")
        captured(*_decode_inputs(tok, prompt.numel(), caches))  # captured
        for bad, why in (([c[:, :, :-1] for c in caches], rf"past_key_0 must be \[B, kv_heads, {L}, head_dim\]"),
                         ([c.float() for c in caches], r"past_key_0 must hold int8 codes")):
            for model in (eager, captured):
                with pytest.raises(ValueError, match=why):
                    model(*_decode_inputs(tok, prompt.numel(), bad))


def test_captured_graph_calls_the_host_implementations_directly(tiny, monkeypatch):
    """The backend (``eager_direct_host_calls``) leaves no dispatcher call to a dal operator in the captured
    decode graph: every host operator's node calls its CPU implementation, each blocked linear is one
    ``dal::quantized_blocked_linear`` call (its input codes made inside), the weight quantizers' outputs
    (the embedding table's, the norms' weights) are the graph's constants (no quantizer call on them);
    two decode steps equal the eager integer model's and dal.npu's on every element."""
    from dal.convert import compiled, host_ops
    from dal.kernels import blocked_sums

    p, _, dec = tiny
    graphs = []
    backend = compiled.eager_direct_host_calls
    monkeypatch.setattr(compiled, "eager_direct_host_calls", lambda gm, ex: graphs.append(gm) or backend(gm, ex))
    prompt = _tokens(9)[0, :5]
    tok, caches = _prefill(p, prompt)
    eager, captured, npu, names = _decode_models(p, dec)
    with torch.no_grad():
        captured(*_decode_inputs(tok, prompt.numel(), caches))
        captured.compile_blocks("")
        for step in range(2):
            x = _decode_inputs(tok, prompt.numel() + step, caches)
            got, want = captured(*x), eager(*x)
            ref = npu.run(dict(zip(names, [t.numpy() for t in x])))
            for a, b, c in zip(got, want, ref):
                assert torch.equal(a, b) and np.array_equal(a.numpy(), np.asarray(c))
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    ops = [t for t in targets if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
    assert not [t for t in ops if t.namespace in ("dal", "dal_convert")], ops
    direct = set(host_ops.direct_calls().values())
    assert {t for t in targets if t in direct} >= {blocked_sums.quantized_cpu}
    blocked = sum(lay.blocked is not None for lay in captured._layers.values())
    assert blocked and targets.count(blocked_sums.quantized_cpu) == blocked
    on_params = [n for n in graphs[0].graph.nodes if n.target in direct and n.args[0].op == "placeholder"
                 and "_parameters_" in n.args[0].name]
    assert not on_params, on_params  # no quantizer call on a parameter (the norms' weights before: cast_round_trip)
    assert any(isinstance(m, IntegerQuantizer) and m._kept_output is not None for m in captured.modules())
