"""``F.scaled_dot_product_attention`` in the integer model (dal.convert.sdpa): the exported
decomposition's arithmetic, checked against numpy's correctly rounded float32 scalar ops and a
float64 oracle, and on a model against dal.npu element by element (timm's ViT computes its
attention with this function; torch's fused kernel made its integer model and dal.npu
disagree on some codes of the next quantizer)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dal.convert.sdpa import attention_scale_root, sdpa_onnx

torch.set_num_threads(1)


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
        r = np.sqrt(np.float32(1.0) / np.sqrt(np.float32(24)))
        qs, ks = q.numpy() * r, np.swapaxes(k.numpy(), -1, -2) * r
        qk = (qs.astype(np.float64) @ ks.astype(np.float64)).astype(np.float32)
        if m is not None:
            qk = qk + m.numpy()
        e = np.exp(qk - qk.max(-1, keepdims=True))
        p = e / e.astype(np.float64).sum(-1, keepdims=True).astype(np.float32)
        want = (p.astype(np.float64) @ v.numpy().astype(np.float64)).astype(np.float32)
        assert (got == want).all()
        ref = F.scaled_dot_product_attention(q, k, v, m).numpy()
        assert np.abs(got - ref).max() < 1e-5  # the same function (float32 rounding apart)


def test_calls_outside_the_covered_form_run_torch():
    q = torch.randn(1, 2, 5, 8)
    assert sdpa_onnx(q, q, q, is_causal=True) is None
    assert sdpa_onnx(q, q, q, scale=0.5) is None
    assert sdpa_onnx(q, q, q, torch.ones(5, 5, dtype=torch.bool)) is None
