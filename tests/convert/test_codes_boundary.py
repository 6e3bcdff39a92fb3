"""dal/convert/codes_boundary.py: the decoder files' codes boundary (CodesStep's DequantizeLinear of
the past KV codes, QuantizeLinear of the new entries) run outside NPUFloatOps' dispatch gives the
integer model's outputs bit for bit as the old route (the same module under the mode), on a tiny
Llama's decode and prefill steps with INT8 and FP8 e4m3 caches holding edge codes (the grid's ends,
every FP8 bit pattern but NaN).

Oracles: the old route (``CodesStep.forward`` under NPUFloatOps, which is how the integer model ran
before), and NPUFloatOps' own table of replaced functions (dal.formats' Q/DQ reaches none of them,
which is what makes running them with handling off the same computation).
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402
from dal.convert.codes_boundary import IntegerCodesStep, integer_boundary  # noqa: E402
from dal.convert.float_ops import NPUFloatOps  # noqa: E402
from dal.export.decoder import causal_mask  # noqa: E402
from dal.export.decoder_module import CodesStep, DecoderStep  # noqa: E402
from dal.formats import dequantize, per_channel, quantize  # noqa: E402

T = pytest.importorskip("transformers")

P, L, KV, D, V = 8, 16, 2, 16, 256
CACHES = {"int8": "w4a8_int8_llm", "fp8_e4m3": "w4a8_fp8_llm"}


class Counting(NPUFloatOps):
    """NPUFloatOps that counts every call it sees and records those it replaces."""

    def __init__(self):
        super().__init__({}, 17)
        self.calls, self.replaced = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if func in self.impl:
            self.replaced.append(func)
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("fmt", ["int8", "uint8", "int4", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("channels", [False, True])
def test_formats_qdq_reach_no_replaced_function(fmt, channels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 4, generator=g) * 3
    s = torch.tensor([0.05, 0.125]) if channels else torch.tensor(0.05)
    gran = per_channel(1) if channels else None
    zp = None
    if fmt == "uint8":
        zp = torch.tensor([128, 3], dtype=torch.int32) if channels else torch.tensor(128)
    mode = Counting()
    with torch.no_grad(), mode:
        c = quantize(x, fmt, s, zp, gran)
        dequantize(c, fmt, s, zp, gran)
    assert mode.calls > 0 and mode.replaced == []


def _llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=KV, intermediate_size=128, vocab_size=V,
                                            max_position_embeddings=128))


def _tokens(seed, n=16, batch=2):
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(CACHES))
def steps(request):
    kv = request.param
    rec = dal.load_recipe(CACHES[kv]).with_rules_prepended(
        [{"type": "kv_cache", "input": {"format": kv, "granularity": "per_tensor", "symmetric": True}}])
    p = dal.prepare_qat(_llama(), recipe=rec, hardware="a2000")
    dal.calibrate(p, [_tokens(1), _tokens(2)])
    return kv, dal.convert(CodesStep(DecoderStep(p, P, False))), dal.convert(CodesStep(DecoderStep(p, L, True)))


def _caches(kind, g):
    """Edge caches: the grid's lowest and highest code everywhere, and random codes over the whole
    grid (int8 -128..127; float8 e4m3fn every bit pattern but NaN 0x7F / 0xFF, +-448 included)."""
    shape = (1, KV, L, D)
    if kind == "int8":
        return {"lowest": [torch.full(shape, -128, dtype=torch.int8)] * 4,
                "highest": [torch.full(shape, 127, dtype=torch.int8)] * 4,
                "random": [torch.randint(-128, 128, shape, generator=g, dtype=torch.int8) for _ in range(4)]}

    def f8(bits):
        return torch.where((bits & 0x7F) == 0x7F, torch.zeros_like(bits), bits).view(torch.float8_e4m3fn)
    return {"lowest": [f8(torch.full(shape, 0xFE, dtype=torch.uint8))] * 4,
            "highest": [f8(torch.full(shape, 0x7E, dtype=torch.uint8))] * 4,
            "random": [f8(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)) for _ in range(4)]}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _old_and_new(im, inputs):
    """The integer model's outputs by the old route (CodesStep.forward under the mode) and the new,
    and how many calls NPUFloatOps dispatched in each."""
    out = {}
    for cls in (CodesStep, IntegerCodesStep):
        im.net.__class__ = cls
        counted = Counting()
        counted.impl = NPUFloatOps({}, im.opset).impl  # the integer model's own table
        with torch.no_grad(), counted:
            im(*inputs)  # nested: the model's own mode runs inside; this one sees the boundary's calls
        out[cls] = ([_bits(t).clone() for t in im(*inputs)], counted.calls)
    assert type(im.net) is IntegerCodesStep
    return out[CodesStep], out[IntegerCodesStep]


def test_converted_decoder_uses_the_integer_boundary(steps):
    _, pre, dec = steps
    assert type(pre.net) is IntegerCodesStep and type(dec.net) is IntegerCodesStep
    assert "CodesStep" in repr(dec.net).splitlines()[0]


def test_decode_same_bits_on_edge_caches(steps):
    kind, _, dec = steps
    g = torch.Generator().manual_seed(3)
    mask = causal_mask(torch.arange(L)[None] < L - 3, 1, True)
    for name, cache in _caches(kind, g).items():
        inputs = (torch.tensor([[7]]), torch.tensor([[L - 3]]), mask, *cache)
        (old, n_old), (new, n_new) = _old_and_new(dec, inputs)
        assert len(new) == 1 + 4
        for i, (a, b) in enumerate(zip(old, new)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{kind} cache {name}: output {i} differs"


def test_prefill_same_bits(steps):
    kind, pre, _ = steps
    ids = _tokens(5, n=P, batch=1)
    inputs = (ids, torch.arange(P)[None], causal_mask(torch.ones(1, P, dtype=torch.bool), P, False))
    (old, _), (new, _) = _old_and_new(pre, inputs)
    for i, (a, b) in enumerate(zip(old, new)):
        assert torch.equal(a, b), f"{kind} prefill: output {i} differs"


def test_boundary_calls_leave_the_dispatch(steps):
    """The outer counting mode sees the boundary's Q/DQ calls on the old route only."""
    kind, _, dec = steps
    cache = _caches(kind, torch.Generator().manual_seed(4))["random"]
    inputs = (torch.tensor([[7]]), torch.tensor([[L - 3]]), causal_mask(torch.arange(L)[None] < L - 3, 1, True),
              *cache)
    (_, n_old), (_, n_new) = _old_and_new(dec, inputs)
    assert n_new < n_old


def test_only_a_plain_codes_step_is_swapped():
    class Mine(CodesStep):
        pass
    m = Mine.__new__(Mine)
    torch.nn.Module.__init__(m)
    assert integer_boundary(m) is False and type(m) is Mine
    assert integer_boundary(torch.nn.Linear(2, 2)) is False
