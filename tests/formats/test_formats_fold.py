"""The BN-fold kernel (dal/formats/fold.py) against the op-by-op chain it replaces,
``FakeQuantizeFunction(W * f) / f`` (the eager reference path), and against float64.

Output and d/dW must be bit-identical (NaN, ties and clipped codes included); d/df is a
per-channel sum the kernel accumulates in double, so it must be at least as close to the
float64 value as the float32 chain is. ``row_minmax`` must give torch's amin / amax of the
product exactly, or decline.
"""
import zlib

import numpy as np
import pytest
import torch

import dal.formats as F
from dal.formats import native
from dal.formats.autograd import FakeQuantizeFunction
from dal.formats.fold import FoldedFakeQuantizeFunction, row_minmax
from formats_common import FP8_FORMATS, INT_FORMATS

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _case(fmt, gran, shape, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    rows = shape[0]
    if ties:  # powers of two everywhere: W * f / s is exact, so half-integer codes are true ties
        s = torch.full(gran.scale_shape(shape), 2.0 ** -6)
        f = 2.0 ** torch.randint(-2, 3, (rows,), generator=gen).float()
        f = f * torch.where(torch.rand(rows, generator=gen) < 0.3, -1.0, 1.0)
        codes = torch.randint(-300, 300, shape, generator=gen).float() / 2  # k and k + 1/2, some far outside
        w = codes * 2.0 ** -6 / f.reshape(-1, *[1] * (len(shape) - 1))
    else:
        s = torch.rand(gran.scale_shape(shape), generator=gen) * 0.02 + 1e-3
        f = torch.randn(rows, generator=gen) + 0.1
        w = torch.randn(shape, generator=gen) * 0.3
        w.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-42])
    zp = torch.zeros(s.shape, dtype=torch.int32)
    if fmt.is_integer and not fmt.signed:
        zp = torch.randint(int(fmt.qmin), int(fmt.qmax) + 1, s.shape, generator=gen, dtype=torch.int32)
    return w, f, s, zp


def _chain(w, f, s, zp, fmt, gran, divide, g):
    """The op-by-op path QConvBn2d takes without the kernel (the eager FakeQuantizeFunction)."""
    w, f = w.clone().requires_grad_(), f.clone().requires_grad_()
    f4 = f.reshape(-1, *[1] * (w.dim() - 1))
    qmin, qmax = F.code_range(fmt)
    q = FakeQuantizeFunction.apply(w * f4, s, zp, fmt, gran, qmin, qmax, 1.0)
    out = q / f4 if divide else q
    gw, gf = torch.autograd.grad(out, (w, f), g)
    return out.detach(), gw, gf, q.detach()


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("gran", [F.PER_TENSOR, F.per_channel(0)], ids=str)
@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS, ids=lambda f: f.name)
def test_fold_kernel_is_bit_identical_to_the_op_by_op_chain(fmt, gran, ties, divide, threads):
    shape = (12, 5, 3, 3) if not ties else (9, 7, 13)  # ragged rows: the scalar tail too
    seed = zlib.crc32(f"{fmt.name}{gran}{ties}".encode())
    w, f, s, zp = _case(fmt, gran, shape, seed, ties)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))  # not the global RNG: order-free
    ref, ref_gw, ref_gf, q = _chain(w, f, s, zp, fmt, gran, divide, g)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wv, fv = w.clone().requires_grad_(), f.clone().requires_grad_()
        qmin, qmax = F.code_range(fmt)
        out = FoldedFakeQuantizeFunction.apply(wv, fv, s, zp, fmt, qmin, qmax, divide)
        gw, gf = torch.autograd.grad(out, (wv, fv), g)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(_bits(out), _bits(ref))  # NaN payloads and -0.0 included
    assert torch.equal(_bits(gw), _bits(ref_gw))
    # d/df against float64 (same codes and mask): sum over each row of g * (m W / f - q / f^2).
    m = (ref_gw != 0) | (g == 0)  # where the chain let the gradient through
    keep = torch.isfinite(w).all(dim=tuple(range(1, w.dim())))
    f64, w64, g64, q64 = f.double(), w.double(), g.double(), q.double()
    fb = f64.reshape(-1, *[1] * (w.dim() - 1))
    terms = g64 * (m.double() * w64 / fb - (q64 / fb ** 2 if divide else 0.0))
    exact = terms.sum(dim=tuple(range(1, w.dim())))
    scale = (g64.abs() * (w64.abs() / fb.abs() + q64.abs() / fb ** 2)).sum(dim=tuple(range(1, w.dim())))
    err_kernel = ((gf.double() - exact).abs() / scale)[keep]
    err_chain = ((ref_gf.double() - exact).abs() / scale)[keep]
    assert bool((err_kernel <= err_chain + 2 ** -23).all()), (err_kernel.max(), err_chain.max())


@pytest.mark.parametrize("fmt", [F.INT8, F.UINT8, F.INT4], ids=lambda f: f.name)
def test_fold_ties_round_half_to_even_like_float64(fmt):
    """The oracle: codes round(W f / s) half to even computed in float64 (exact here)."""
    w, f, s, zp = _case(fmt, F.per_channel(0), (8, 40), 5, ties=True)
    qmin, qmax = F.code_range(fmt)
    out = FoldedFakeQuantizeFunction.apply(w, f, s, zp, fmt, qmin, qmax, False)
    v = (w.double() * f.double()[:, None]) / s.double()[:, None]
    assert bool((v - v.floor() == 0.5).any())  # ties exist
    codes = np.clip(np.round(v.numpy()) + zp.double().numpy()[:, None], qmin, qmax) - zp.double().numpy()[:, None]
    np.testing.assert_array_equal(out.double().numpy(), codes * s.double().numpy()[:, None])


def test_row_minmax_is_torchs_amin_amax_or_declines():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(33, 7, 3, 3, generator=gen)
    f = torch.randn(33, generator=gen)
    lo, hi = row_minmax(w, f)
    t = w * f[:, None, None, None]
    assert torch.equal(_bits(lo), _bits(t.amin(dim=(1, 2, 3))))
    assert torch.equal(_bits(hi), _bits(t.amax(dim=(1, 2, 3))))
    lo, hi = row_minmax(w)
    assert torch.equal(lo, w.amin(dim=(1, 2, 3))) and torch.equal(hi, w.amax(dim=(1, 2, 3)))
    for bad in (float("nan"), float("inf"), 0.0):
        x = w.clone()
        x[4] = x[4].abs() if bad == 0.0 else x[4]
        x[4, 0, 0, 0] = bad  # a NaN, an infinite extreme, a zero extreme (the sign of zero is torch's call)
        assert row_minmax(x) is None
    for bad_f in (0.0, float("inf")):
        g = f.clone()
        g[2] = bad_f
        assert row_minmax(w, g) is None
