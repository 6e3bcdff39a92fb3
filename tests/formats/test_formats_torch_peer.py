"""dal against torch's own fake-quant ops: where they must differ (division vs multiplication),
where they must agree (STE mask), and LSQ gradients against torch and a float64 formula."""
import numpy as np
import pytest
import torch

import dal.formats as F
from formats_oracle import run


def _near_ties(rng, scale, n):
    """float32 x with x / scale within a few ulps of k + 0.5: where x / s and x * (1 / s) round apart."""
    k = rng.integers(-127, 127, n)
    x = ((k + 0.5) * np.float64(scale)).astype(np.float32)
    steps = rng.integers(-3, 4, n)
    return (x.view(np.int32) + steps.astype(np.int32)).view(np.float32)  # a few ulps either side


def test_differs_from_torch_exactly_where_division_and_multiplication_disagree():
    rng = np.random.default_rng(7)
    found = 0
    for scale in np.array([0.0123, 0.1, 0.3, 1.7, 0.02731], np.float32):
        x = np.concatenate([_near_ties(rng, scale, 200_000), rng.standard_normal(200_000).astype(np.float32)])
        inv = np.float32(1.0) / scale
        by_div = np.clip(np.rint(x / scale), -128, 127)
        by_mul = np.clip(np.rint(x * inv), -128, 127)
        disagree = by_div != by_mul
        xt = torch.from_numpy(x)
        ours = F.fake_quantize(xt, "int8", float(scale)).numpy()
        theirs = torch.fake_quantize_per_tensor_affine(xt, float(scale), 0, -128, 127).numpy()
        np.testing.assert_array_equal(ours != theirs, disagree)
        # dal is ONNX: on every disagreeing element onnxruntime and onnx.reference follow dal
        idx = np.flatnonzero(disagree)
        for oracle in ("ort", "ref"):
            _, deq = run(oracle, F.INT8, x[idx], np.array(scale), np.zeros((), np.int64))
            np.testing.assert_array_equal(deq, ours[idx])
        found += idx.size
    assert found > 100, f"the search found only {found} disagreeing elements"


def test_power_of_two_scales_agree_with_torch_everywhere():
    x = torch.randn(100_000) * 50
    for k in (-6, -3, 0, 2):
        np.testing.assert_array_equal(F.fake_quantize(x, "int8", 2.0 ** k).numpy(),
                                      torch.fake_quantize_per_tensor_affine(x, 2.0 ** k, 0, -128, 127).numpy())


@pytest.mark.parametrize("fmt", ["int8", "uint8", "int4", "uint4"])
@pytest.mark.parametrize("pow2", [True, False])
def test_ste_gradient_mask_matches_torch_per_channel(fmt, pow2):
    fmt = F.get_format(fmt)
    g = torch.Generator().manual_seed(3)
    C = 6
    x = (torch.randn(4, C, 9, 9, generator=g) * 8).requires_grad_()
    scale = 2.0 ** torch.randint(-4, 0, (C,), generator=g).float() if pow2 else torch.rand(C, generator=g) * 0.1 + 0.01
    zp = torch.randint(int(fmt.qmin), int(fmt.qmax) + 1, (C,), generator=g, dtype=torch.int32)
    dy = torch.randn(x.shape, generator=g)
    ours = F.fake_quantize(x, fmt, scale, zp, F.per_channel(1))
    (gx,) = torch.autograd.grad(ours, x, dy)
    theirs = torch.fake_quantize_per_channel_affine(x, scale, zp, 1, int(fmt.qmin), int(fmt.qmax))
    (gt,) = torch.autograd.grad(theirs, x, dy)
    same_fwd = ours == theirs
    if pow2:
        assert bool(same_fwd.all())
    assert same_fwd.float().mean() > 0.999
    np.testing.assert_array_equal(gx[same_fwd].numpy(), gt[same_fwd].numpy())
    assert 0 < int((gx == 0).sum()) < x.numel()  # some clipped, some not


def _lsq_reference(x, s, zp, qmin, qmax, dy, g, axis=None):
    """LSQ / LSQ+ in float64, written from the papers: inside the range the rounding is a
    straight-through identity, so d/ds [(round(x/s)+zp-zp) s] = round(x/s) - x/s, d/dzp = 0;
    clipped to q in {qmin, qmax}: out = (q - zp) s, so d/ds = q - zp and d/dzp = -s."""
    x, dy = x.double(), dy.double()
    shape = [1] * x.dim()
    if axis is not None:
        shape[axis] = -1
    s64, zp64 = s.double().reshape(shape), torch.round(zp.double()).reshape(shape)
    v = x / s64
    r = torch.round(v) + zp64
    inside = (r >= qmin) & (r <= qmax)
    ds = torch.where(inside, torch.round(v) - v, torch.clamp(r, qmin, qmax) - zp64) * dy
    dz = torch.where(inside, torch.zeros_like(v), -s64.expand_as(v)) * dy
    dims = [d for d in range(x.dim()) if d != axis] if axis is not None else list(range(x.dim()))
    return ds.sum(dims) * g, dz.sum(dims) * g


@pytest.mark.parametrize("per_channel", [False, True])
def test_lsq_gradients_match_float64_formula_and_torch(per_channel):
    gen = torch.Generator().manual_seed(11)
    C, qmin, qmax, g = 5, 0, 255, 0.05
    x = torch.randn(8, C, 6, generator=gen) * 3
    shape = (C,) if per_channel else ()
    scale = (torch.rand(shape, generator=gen) * 0.02 + 0.01).requires_grad_()
    zp = torch.full(shape, 120.0).requires_grad_()
    dy = torch.randn(x.shape, generator=gen)
    gran = F.per_channel(1) if per_channel else F.PER_TENSOR
    out = F.fake_quantize(x, "uint8", scale, zp, gran, learnable=True, grad_scale=g, check=False)
    ds, dz = torch.autograd.grad(out, (scale, zp), dy)
    rs, rz = _lsq_reference(x, scale.detach(), zp.detach(), qmin, qmax, dy, g, 1 if per_channel else None)
    torch.testing.assert_close(ds.double(), rs.reshape(shape), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dz.double(), rz.reshape(shape), rtol=1e-4, atol=1e-5)
    # torch's learnable op multiplies both gradients by its grad_factor, as dal does by grad_scale
    s2, z2 = scale.detach().clone().requires_grad_(), zp.detach().clone().requires_grad_()
    if per_channel:
        t = torch._fake_quantize_learnable_per_channel_affine(x, s2, z2, 1, qmin, qmax, g)
    else:
        t = torch._fake_quantize_learnable_per_tensor_affine(x, s2.reshape(1), z2.reshape(1), qmin, qmax, g)
    ts, tz = torch.autograd.grad(t, (s2, z2), dy)
    torch.testing.assert_close(ds, ts.reshape(shape), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(dz, tz.reshape(shape), rtol=1e-3, atol=1e-4)


def test_lsq_scale_gradient_against_finite_differences():
    """Away from rounding boundaries the true function s * clamp(round(x / s)) has derivative
    c = clamp(round(v)) (the codes are locally constant); LSQ adds the straight-through term
    -v inside the range. So LSQ = finite difference of the float64 function - sum(dy * v * inside)."""
    gen = torch.Generator().manual_seed(5)
    s0 = 0.05
    x = torch.randn(4000, generator=gen).double() * 4
    v = x / s0
    x = x[(v - torch.floor(v) - 0.5).abs() > 0.1]   # far from a rounding step (frac = 0.5)
    v = x / s0
    dy = torch.randn(x.shape, generator=gen).double()

    def f(s):
        return (torch.clamp(torch.round(x / s), -128, 127) * s * dy).sum()

    h = 1e-7
    fd = (f(s0 + h) - f(s0 - h)) / (2 * h)
    inside = (torch.round(v) >= -128) & (torch.round(v) <= 127)
    expected = fd - (dy * v * inside).sum()
    scale = torch.tensor(s0, dtype=torch.float32, requires_grad=True)
    out = F.fake_quantize(x.float(), "int8", scale, learnable=True, check=False)
    (ds,) = torch.autograd.grad(out, scale, dy.float())
    assert abs(float(ds) - float(expected)) <= 1e-3 * abs(float(expected)) + 1e-2
