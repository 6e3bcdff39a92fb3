"""npu_attention: the replaced attention equals the original in float mode (quantizers off / not
yet calibrated) within 1e-5 relative, for nn.MultiheadAttention, torchvision Swin (V1, V2) and
SDPA calls; its products are explicit matmuls that prepare_qat turns into QMatMul."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.nn.own_forward import trace_own_forward
from dal.replace import auto_replace
from dal.replace.mha import NpuMultiheadAttention

from replace_common import rel_err, small_transformer


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool_attn", "float_attn", "padding", "both"])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_mha_equals_original(batch_first, masks, need_weights, average):
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first).eval()
    b, lq = 3, 5
    x = torch.randn(b, lq, 16) if batch_first else torch.randn(lq, b, 16)
    attn_mask = key_padding_mask = None
    if masks in ("bool_attn", "both"):
        attn_mask = torch.rand(lq, lq) > 0.7
        attn_mask.fill_diagonal_(False)
    if masks == "float_attn":
        attn_mask = torch.randn(b * 4, lq, lq)
    if masks in ("padding", "both"):
        key_padding_mask = torch.zeros(b, lq, dtype=torch.bool)
        key_padding_mask[:, -1] = True
    kw = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=need_weights,
              average_attn_weights=average)
    ref, ref_w = mha(x, x, x, **kw)
    npu = NpuMultiheadAttention(mha)
    out, w = npu(x, x, x, **kw)
    assert rel_err(out, ref) < 1e-5
    if need_weights:
        assert w.shape == ref_w.shape and rel_err(w, ref_w) < 1e-5
    else:
        assert w is None


def test_mha_cross_attention_kdim_vdim_and_shared_storage():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(16, 2, kdim=12, vdim=10, batch_first=True).eval()
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 6, 12), torch.randn(2, 6, 10)
    npu = NpuMultiheadAttention(mha)
    assert rel_err(npu(q, k, v)[0], mha(q, k, v)[0]) < 1e-5
    assert npu.q_proj.weight is mha.q_proj_weight and npu.out_proj.weight is mha.out_proj.weight
    packed = nn.MultiheadAttention(8, 2)
    p = NpuMultiheadAttention(packed)
    assert p.k_proj.weight.data_ptr() == packed.in_proj_weight[8:16].data_ptr()  # a view, not a copy


@pytest.mark.parametrize("packed", [True, False])
def test_mha_gradients_equal_the_originals(packed):
    """torch's autograd through the original nn.MultiheadAttention is the oracle: the replacement's
    gradients w.r.t. the q/k/v/out projections (weights and biases) and the inputs agree within
    float32 rounding, 1e-5 of the largest element (the two sum in different orders)."""
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    # packed: one in_proj_weight; kdim/vdim != embed_dim: separate q/k/v weights (cross attention)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, **({} if packed else dict(kdim=6, vdim=5)))
    with torch.no_grad():
        for p in mha.parameters():  # non-zero biases (torch initialises them to 0)
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    npu = NpuMultiheadAttention(mha)  # train mode, dropout 0
    q = torch.randn(2, 3, 8, generator=g)
    k, v = (q, q) if packed else (torch.randn(2, 4, 6, generator=g), torch.randn(2, 4, 5, generator=g))
    pad = torch.zeros(2, k.shape[1], dtype=torch.bool)
    pad[0, -1] = True
    dy = torch.randn(2, 3, 8, generator=g)  # a generic upstream gradient, not sum()'s ones

    def grads(module, names):
        inputs = [t.clone().requires_grad_() for t in ((q,) if packed else (q, k, v))]
        qi, ki, vi = inputs * 3 if packed else inputs
        out = module(qi, ki, vi, key_padding_mask=pad, need_weights=False)[0]
        return torch.autograd.grad(out, [*inputs, *(module.get_parameter(n) for n in names)], dy)

    inputs = ["x"] if packed else ["query", "key", "value"]
    if packed:
        gx, gw, gb, gow, gob = grads(mha, ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"])
        ref = {"x": gx}
        for i, n in enumerate("qkv"):
            ref[f"{n}_proj.weight"] = gw[8 * i:8 * (i + 1)]
    else:
        *gi, gq, gk, gv, gb, gow, gob = grads(mha, ["q_proj_weight", "k_proj_weight", "v_proj_weight",
                                                    "in_proj_bias", "out_proj.weight", "out_proj.bias"])
        ref = dict(zip(inputs, gi))
        ref.update({"q_proj.weight": gq, "k_proj.weight": gk, "v_proj.weight": gv})
    for i, n in enumerate("qkv"):
        ref[f"{n}_proj.bias"] = gb[8 * i:8 * (i + 1)]
    ref.update({"out_proj.weight": gow, "out_proj.bias": gob})
    names = [n for n in ref if n not in inputs]
    got = dict(zip([*inputs, *names], grads(npu, names)))
    assert set(got) == set(ref) and len(names) == 8
    for n, want in ref.items():
        if n == "k_proj.bias":
            # Exactly 0 in real arithmetic (softmax is invariant to adding q.b_k to every score of a
            # row): both must be float32 rounding noise next to the k weight's gradient.
            scale = float(ref["k_proj.weight"].abs().max())
            assert float(want.abs().max()) < 1e-5 * scale and float(got[n].abs().max()) < 1e-5 * scale
            continue
        assert want.abs().max() > 0, n
        assert rel_err(got[n], want) < 1e-5, (n, rel_err(got[n], want))


def test_transformer_encoder_float_equal_and_traceable():
    m = small_transformer()
    x = torch.randn(2, 7, 32)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, -2:] = True
    with torch.no_grad():
        ref, ref_pad = m(x), m[0](x, src_key_padding_mask=pad)
    rep = auto_replace(m, ["npu_attention", "lut_activation", "layernorm_fp16"], "a2000", (x,))
    assert len(rep.by_rule("npu_attention")) == 2 and all(r.cosine > 0.999999 for r in rep.replacements)
    with torch.no_grad():
        assert rel_err(m(x), ref) < 1e-5
        out_pad = m[0](x, src_key_padding_mask=pad)
    assert rel_err(out_pad[~pad], ref_pad[~pad]) < 1e-5  # padded positions: torch's fast path zeros them
    assert m[0].use_nested_tensor is False
    for name in ("0.layers.0.self_attn", "0.layers.0.self_attn.core"):
        trace_own_forward(m.get_submodule(name))  # prepare's fx rewrite must succeed


def test_prepare_turns_products_into_qmatmul():
    m = small_transformer()
    x = torch.randn(2, 7, 32)
    rec = {"name": "a", "replace": ["npu_attention"],
           "rules": [{"type": ["linear", "matmul"], "weight": "int8", "input": {"format": "uint8"}}]}
    q = dal.prepare_qat(m, rec, hardware="a2000", example_inputs=(x,))
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    assert rows["0.layers.0.self_attn.core.matmul"].type_name == "QMatMul"
    assert rows["0.layers.0.self_attn.core.matmul_1"].type_name == "QMatMul"
    assert rows["0.layers.0.self_attn.q_proj"].type_name == "QLinear"
    assert not any("does not trace" in n for n in dal.prepared(q).report.notes)


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("shift", [[0, 0], [2, 2]])
def test_swin_window_attention_equals_original(v2, shift):
    from torchvision.models.swin_transformer import ShiftedWindowAttention, ShiftedWindowAttentionV2

    torch.manual_seed(3)
    cls = ShiftedWindowAttentionV2 if v2 else ShiftedWindowAttention
    attn = cls(32, [4, 4], shift, 4).eval()
    with torch.no_grad():
        attn.qkv.bias.normal_()  # V2 ignores the k part: the replacement must too
    model = nn.Sequential(attn)
    x = torch.randn(2, 10, 9, 32)  # padded to 12x12: exercises pad, shift and mask
    with torch.no_grad():
        ref = model(x)
    rep = auto_replace(model, ["npu_attention"], None, (x,))
    assert type(model[0]).__name__ == "NpuShiftedWindowAttention"
    assert model[0].qkv is attn.qkv and model[0].proj is attn.proj
    with torch.no_grad():
        assert rel_err(model(x), ref) < 1e-5
    assert rep.replacements[0].cosine > 0.999999
    trace_own_forward(model[0])
    if v2:
        assert any("k-part zeroed" in n for n in rep.notes)


class _SDPABlock(nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.qkv, self.proj, self.causal = nn.Linear(16, 48), nn.Linear(16, 16), causal

    def forward(self, x, mask=None):
        b, l, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, l, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return x + self.proj(y.transpose(1, 2).reshape(b, l, 16))


@pytest.mark.parametrize("causal,mask", [(False, None), (True, None), (False, "bool"), (False, "float")])
def test_sdpa_call_is_rewritten(causal, mask):
    torch.manual_seed(4)
    blk = _SDPABlock(causal).eval()
    x = torch.randn(2, 5, 16)
    m = None if mask is None else (torch.rand(5, 5) > 0.3).fill_diagonal_(True) if mask == "bool" \
        else torch.randn(2, 1, 5, 5)
    ref = blk(x, m)
    model = nn.Sequential(blk)
    auto_replace(model, ["npu_attention"])
    new = model[0]
    assert isinstance(new, _SDPABlock) and hasattr(new, "npu_sdpa") and new.qkv is blk.qkv
    assert rel_err(new(x, m), ref) < 1e-5


def test_sdpa_block_prepares_with_qmatmul_and_qadd():
    blk = nn.Sequential(_SDPABlock())
    rec = {"name": "s", "replace": ["npu_attention"],
           "rules": [{"type": ["linear", "matmul", "add"], "weight": "int8", "input": "uint8"}]}
    q = dal.prepare_qat(blk, rec, hardware="a2000", example_inputs=(torch.randn(2, 5, 16),))
    types = {r.name: r.type_name for r in dal.prepared(q).report.rows}
    assert types["0.npu_sdpa.core.matmul"] == "QMatMul" and "QAdd" in types.values()
