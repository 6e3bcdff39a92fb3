"""``F.scaled_dot_product_attention`` in the integer model (dal.convert.sdpa): the exported
decomposition's arithmetic, checked against numpy's correctly rounded float32 scalar ops and a
float64 oracle, and on a model against dal.npu element by element (timm's ViT computes its
attention with this function; torch's fused kernel made its integer model and dal.npu
disagree on some codes of the next quantizer). dal.convert must spell it at the opset the
export moves to (14, not the formats' 13: dal/convert/opset.py), or it runs that kernel."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
import dal.npu
from convert_common import assert_bit_exact, build, random_batches
from dal.convert import ConvertError
from dal.convert.sdpa import attention_scale_root, sdpa_onnx
from dal.export import ExportError
from export_common import prepared

torch.set_num_threads(1)


def _numpy_decomposition(q, k, v, mask=None):
    """The exported SDPA nodes with numpy's float32 ops, float64 MatMuls rounded once and the
    Softmax of export/SPEC.md §5a (np.exp, float64 sum, one float32 division): the oracle."""
    r = np.sqrt(np.float32(1.0) / np.sqrt(np.float32(q.shape[-1])))
    qs, ks = q * r, np.swapaxes(k, -1, -2) * r
    qk = (qs.astype(np.float64) @ ks.astype(np.float64)).astype(np.float32)
    if mask is not None:
        qk = qk + mask
    e = np.exp(qk - qk.max(-1, keepdims=True))
    p = e / e.astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
    return (p.astype(np.float64) @ v.astype(np.float64)).astype(np.float32)


@pytest.mark.parametrize("embed", [1, 2, 3, 7, 16, 24, 48, 64, 80, 96, 128, 192, 1000])
def test_scale_root_is_the_exported_float32_nodes(embed):
    """Sqrt(Div(1, Sqrt(Cast(E)))) with numpy's float32 ops (IEEE: each correctly rounded)."""
    e = np.float32(embed)
    want = np.sqrt(np.float32(1.0) / np.sqrt(e))
    assert want.dtype == np.float32 and attention_scale_root(embed) == float(want)


def test_sdpa_form_is_the_decomposition_with_float64_matmuls():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 24, generator=g) for _ in range(3))
    mask = torch.randn(17, 17, generator=g)
    for m in (None, mask):
        got = sdpa_onnx(q, k, v, m).numpy()
        want = _numpy_decomposition(q.numpy(), k.numpy(), v.numpy(), None if m is None else m.numpy())
        assert (got == want).all()
        ref = F.scaled_dot_product_attention(q, k, v, m).numpy()
        assert np.abs(got - ref).max() < 1e-5  # the same function (float32 rounding apart)


def test_calls_outside_the_covered_form_run_torch():
    q = torch.randn(1, 2, 5, 8)
    assert sdpa_onnx(q, q, q, is_causal=True) is None
    assert sdpa_onnx(q, q, q, scale=0.5) is None
    assert sdpa_onnx(q, q, q, torch.ones(5, 5, dtype=torch.bool)) is None


class _Attention(nn.Module):
    """timm's Attention with fused_attn: qkv Linear, SDPA over heads, proj Linear."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


#: seeds of the model test. Before dal.convert took the export's opset (14, not the formats' 13),
#: seeds 0, 1, 3 and 6 differed from dal.npu on 1 to 8 codes of proj's quantizers (torch's
#: fused float32 attention instead of the exported nodes); seed 0, batch 1: 1 code of
#: proj.input_quant and 3 of proj.output_quant, of 25600 each
MODEL_SEEDS = range(8)


@pytest.mark.parametrize("seed", MODEL_SEEDS)
def test_attention_model_bit_exact_with_the_npu(seed):
    torch.manual_seed(seed)  # the model's weights and x: not the RNG state earlier tests left
    x = torch.randn(2, 50, 64)
    qat, proto, sess = build(_Attention(), x, "a2000")
    assert any(n.op_type == "Softmax" for n in proto.graph.node)  # the exporter's decomposition
    im = dal.convert(copy.deepcopy(qat), (x,))
    batches = random_batches((8, 50, 64), n=4, seed=100 + seed)
    assert_bit_exact(im, proto, sess, batches, f"attention with SDPA, seed {seed}")


class _SdpaOfInput(nn.Module):
    """SDPA straight on the (float) graph input, its result a graph output; a Linear beside it
    so that the model has quantizers to prepare, export and convert."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        h = x.reshape(b, n, self.heads, c // self.heads).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h * 0.5, h), self.lin(x)


def test_default_opset_is_the_one_the_export_moves_to():
    """The root cause of the model test's codes: ``dal.export_onnx`` writes a model calling SDPA at
    opset 14 (torch names it, the exporter retries), dal.convert took the formats' 13 and so ran
    torch's fused float32 kernel instead of the exported nodes. Checked against the file's own
    opset and the numpy decomposition of the nodes (``_numpy_decomposition``)."""
    torch.manual_seed(0)
    x = torch.randn(4, 40, 32)
    qat = prepared(_SdpaOfInput(), x, "int8_balanced", "a2000")
    proto = dal.export_onnx(qat, (x,), dynamic_batch=True)
    file_opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    assert file_opset == 14
    im = dal.convert(copy.deepcopy(qat), (x,))
    assert im.opset == file_opset
    h = x.reshape(4, 40, 2, 16).transpose(1, 2)
    want = _numpy_decomposition(h.numpy(), (h * 0.5).numpy(), h.numpy())
    got = im(x)[0].numpy()  # torch's fused kernel (opset 13): 4229 of 5120 elements differed
    assert (got == want).all(), f"{int((got != want).sum())} of {got.size} elements differ"
    npu = dal.npu.load(proto, threads=1).run({"input": x.numpy()})[0]
    assert (npu == want).all()  # the reference runtime follows the file's nodes too


def test_an_explicit_opset_below_sdpa_is_refused_as_the_exporter_refuses_it():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 32)
    qat = prepared(_SdpaOfInput(), x, "int8_balanced", "a2000")
    with pytest.raises(ExportError):
        dal.export_onnx(qat, (x,), opset=13)
    with pytest.raises(ConvertError, match=r"opset=13 cannot hold F.scaled_dot_product_attention"):
        dal.convert(copy.deepcopy(qat), (x,), opset=13)
    assert dal.convert(copy.deepcopy(qat), (x,), opset=17).opset == 17
