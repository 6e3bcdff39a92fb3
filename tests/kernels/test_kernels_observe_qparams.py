"""dal::observe_minmax_ and dal::minmax_qparams against numpy (float32 / float64 formulas written here),
and dal::fp_round_trip against torch's own casts; torch.library.opcheck on each."""
import numpy as np
import pytest
import torch

import dal.kernels as K
from dal.formats import FORMATS, PER_TENSOR, per_channel, per_group


def _np_extremes(x, gran):
    """Finite min / max per scale, +inf / -inf for a slice without a finite value (numpy)."""
    x = np.asarray(x, np.float32)
    fin = np.isfinite(x)
    lo_src, hi_src = np.where(fin, x, np.inf), np.where(fin, x, -np.inf)
    axis = gran.normalized_axis(x.ndim)
    if axis is None:
        return np.float32(lo_src.min()), np.float32(hi_src.max())
    if not gran.block_size:
        dims = tuple(d for d in range(x.ndim) if d != axis)
        return lo_src.min(axis=dims), hi_src.max(axis=dims)
    shape = list(x.shape)
    shape[axis:axis + 1] = [shape[axis] // gran.block_size, gran.block_size]
    return lo_src.reshape(shape).min(axis=axis + 1), hi_src.reshape(shape).max(axis=axis + 1)


GRANS = [PER_TENSOR, per_channel(1), per_group(2, 5)]


@pytest.mark.parametrize("gran", GRANS, ids=str)
@pytest.mark.parametrize("ema", [0.0, 0.25])
@pytest.mark.parametrize("path", ["cpu", "generic"])
@pytest.mark.parametrize("nonfinite", [True, False], ids=["nonfinite", "finite"])
def test_observe_minmax_update(gran, ema, path, nonfinite):
    """Each path (the CPU implementation, whose all-finite batches skip the masking, and the
    device-generic one, forced) against numpy."""
    from dal.kernels import observer_update
    run = observer_update.generic if path == "generic" else K.observe_minmax_
    rng = np.random.default_rng(11)
    batches = [rng.normal(0, s, (4, 6, 10)).astype(np.float32) for s in (1.0, 3.0, 0.5)]
    if nonfinite:
        batches[1].reshape(-1)[[0, 7, 30]] = [np.nan, np.inf, -np.inf]
        batches[2][:, 2] = np.nan  # channel 2 of this batch has no finite value at all
    lo0, hi0 = _np_extremes(batches[0], gran)
    mn, mx = torch.tensor(lo0), torch.tensor(hi0)
    seen, bad = torch.tensor(1), torch.tensor(0)
    exp_lo, exp_hi = np.array(lo0, np.float32), np.array(hi0, np.float32)
    c = np.float32(ema)
    for b in batches[1:]:
        run(torch.from_numpy(b), mn, mx, seen, bad, ema, gran.normalized_axis(3), gran.block_size)
        lo, hi = _np_extremes(b, gran)
        if ema == 0.0:
            exp_lo, exp_hi = np.minimum(exp_lo, lo), np.maximum(exp_hi, hi)
        else:
            lo, hi = np.where(np.isfinite(lo), lo, exp_lo), np.where(np.isfinite(hi), hi, exp_hi)
            exp_lo = (exp_lo + c * (lo - exp_lo)).astype(np.float32)
            exp_hi = (exp_hi + c * (hi - exp_hi)).astype(np.float32)
    np.testing.assert_array_equal(mn.numpy(), exp_lo)
    np.testing.assert_array_equal(mx.numpy(), exp_hi)
    assert int(seen) == 3 and int(bad) == (3 + 40 if nonfinite else 0)


def test_observe_matches_dal_observer():
    """The op's buffers equal MinMaxObserver's / MovingAverageMinMaxObserver's after the same batches."""
    from dal.observers import make_observer
    rng = np.random.default_rng(2)
    for name in ("minmax", "moving_average"):
        obs = make_observer(name, FORMATS["int8"], per_channel(1), True, False)
        xs = [torch.from_numpy(rng.normal(0, 1 + i, (4, 6, 10)).astype(np.float32)) for i in range(4)]
        obs(xs[0])
        mn, mx = obs.min_val.clone(), obs.max_val.clone()
        seen, bad = obs.batches_seen.clone(), obs.nonfinite_count.clone()
        c = getattr(obs, "averaging_constant", 0.0)
        for x in xs[1:]:
            obs(x)
            K.observe_minmax_(x, mn, mx, seen, bad, c, 1, 0)
        assert torch.equal(mn, obs.min_val) and torch.equal(mx, obs.max_val)
        assert torch.equal(seen, obs.batches_seen)
        s, z = K.minmax_qparams(mn, mx, "int8", True, False, None)
        s_ref, z_ref = obs.calculate_qparams()
        assert torch.equal(s, s_ref) and torch.equal(z, z_ref)


def _np_qparams(lo, hi, fmt, symmetric):
    """Float64 formula of ONNX-style qparams (range widened to contain 0), rounded once to float32."""
    lo = np.minimum(np.where(np.isfinite(lo), lo, 0), 0).astype(np.float64)
    hi = np.maximum(np.where(np.isfinite(hi), hi, 0), 0).astype(np.float64)
    if fmt.is_float8:
        scale, zp = np.maximum(-lo, hi) / fmt.max_value, np.zeros(lo.shape)
    elif symmetric:
        mid = 0 if fmt.signed else (fmt.qmin + fmt.qmax + 1) // 2
        scale, zp = np.maximum(-lo, hi) / (fmt.qmax - mid), np.full(lo.shape, mid)
    else:
        scale = (hi - lo) / (fmt.qmax - fmt.qmin)
        safe = np.where(scale > 0, scale, 1.0)
        zp = np.clip(fmt.qmin - np.rint(lo / safe), fmt.qmin, fmt.qmax)
    scale = np.where(scale > 0, scale, 1.0)
    return np.maximum(scale, 2.0 ** -100).astype(np.float32), zp.astype(np.int32)


@pytest.mark.parametrize("fmt,symmetric", [("int8", True), ("uint8", False), ("uint8", True), ("int4", True),
                                           ("fp8_e4m3", True)])
def test_minmax_qparams(fmt, symmetric):
    fmt = FORMATS[fmt]
    rng = np.random.default_rng(4)
    lo = np.concatenate([-rng.uniform(0, 5, 20), [0.0, -0.0, np.inf, 1.0]]).astype(np.float32)
    hi = np.concatenate([rng.uniform(0, 5, 20), [0.0, 0.0, -np.inf, 2.0]]).astype(np.float32)
    s, z = K.minmax_qparams(torch.from_numpy(lo), torch.from_numpy(hi), fmt.name, symmetric, False, None)
    es, ez = _np_qparams(lo, hi, fmt, symmetric)
    np.testing.assert_array_equal(s.numpy(), es)
    np.testing.assert_array_equal(z.numpy(), ez)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp_round_trip(dtype):
    x = torch.randn(3, 1000) * 1e3
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), 1e6, -0.0])
    xr = x.clone().requires_grad_()
    y = K.fp_round_trip(xr, dtype)
    ref = x.to(dtype).to(torch.float32)
    assert torch.equal(y[1:].detach(), ref[1:]) and torch.equal(y.isnan(), ref.isnan())
    g = torch.randn_like(x)
    y.backward(g)
    assert torch.equal(xr.grad, g)
    cl = (torch.randn(2, 4, 3, 3) * 1e3).contiguous(memory_format=torch.channels_last)
    assert torch.equal(K.fp_round_trip(cl, dtype), cl.to(dtype).float())


def test_opcheck_observe_qparams_cast():
    x = torch.randn(4, 6, 10)
    for gran in GRANS:
        lo, hi = (t.contiguous() for t in K.observer_update.batch_extremes(x, gran.normalized_axis(3),
                                                                           gran.block_size))
        for c in (0.0, 0.1):
            torch.library.opcheck(torch.ops.dal.observe_minmax_.default,
                                  (x * 2, lo.clone(), hi.clone(), torch.tensor(1), torch.tensor(0), c,
                                   gran.normalized_axis(3), gran.block_size))
        torch.library.opcheck(torch.ops.dal.minmax_qparams.default, (lo, hi, "uint8", False, False, None))
        torch.library.opcheck(torch.ops.dal.minmax_qparams.default, (lo, hi, "int8", True, True, "cover"))
    for dtype in (torch.float16, torch.bfloat16):
        torch.library.opcheck(torch.ops.dal.fp_round_trip.default, (x.clone().requires_grad_(), dtype))
