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


def test_mha_gradients_reach_projections():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    npu = NpuMultiheadAttention(mha)
    x = torch.randn(2, 3, 8)
    npu(x, x, x)[0].sum().backward()
    assert all(p.grad is not None for p in npu.parameters())


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
    rows = {r.name: r for r in q.dal_report.rows}
    assert rows["0.layers.0.self_attn.core.matmul"].type_name == "QMatMul"
    assert rows["0.layers.0.self_attn.core.matmul_1"].type_name == "QMatMul"
    assert rows["0.layers.0.self_attn.q_proj"].type_name == "QLinear"
    assert not any("does not trace" in n for n in q.dal_report.notes)


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
    types = {r.name: r.type_name for r in q.dal_report.rows}
    assert types["0.npu_sdpa.core.matmul"] == "QMatMul" and "QAdd" in types.values()
