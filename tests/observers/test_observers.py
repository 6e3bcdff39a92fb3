"""Observers: statistics against torch / numpy / float64 formulas written here."""
import math

import numpy as np
import pytest
import torch

import dal.formats as F
from dal.observers import (OBSERVERS, KLObserver, MinMaxObserver, MovingAverageMinMaxObserver, MSEObserver,
                           PercentileObserver, make_observer)


def _qparams64(lo, hi, fmt, symmetric, narrow=False):
    """choose_qparams restated in float64 from its contract."""
    fmt = F.get_format(fmt)
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    qmin, qmax = fmt.qmin + (1 if narrow and fmt.is_integer and fmt.signed else 0), fmt.qmax
    if fmt.is_float8:
        scale, zp = max(-lo, hi) / fmt.max_value, 0
    elif symmetric:
        zp = 0 if fmt.signed else (qmin + qmax + 1) // 2
        scale = max(-lo, hi) / (qmax - zp)
    else:
        scale = (hi - lo) / (qmax - qmin)
        # an all-zero range gets scale 1, and then zp = qmin - round(0 / 1) = qmin
        zp = int(np.clip(qmin - np.round(lo / (scale or 1.0)), qmin, qmax))
    return (scale if scale > 0 else 1.0), zp


@pytest.mark.parametrize("fmt,symmetric,narrow", [
    ("int8", True, False), ("int8", True, True), ("int8", False, False), ("uint8", True, False),
    ("uint8", False, False), ("int4", True, False), ("uint4", False, False), ("int16", True, False),
    ("fp8_e4m3", True, False), ("fp8_e5m2", True, False)])
def test_choose_qparams_against_float64_formula(fmt, symmetric, narrow):
    rng = np.random.default_rng(1)
    ranges = [(-1.0, 2.0), (0.5, 3.0), (-7.0, -0.25), (-3e-3, 1e-4), (0.0, 0.0), (-1e4, 1e4)]
    for lo, hi in ranges + [tuple(sorted(rng.normal(0, 5, 2))) for _ in range(20)]:
        s, z = F.choose_qparams(torch.tensor(lo), torch.tensor(hi), fmt, symmetric, narrow)
        es, ez = _qparams64(np.float32(lo), np.float32(hi), fmt, symmetric, narrow)
        assert s.dtype == torch.float32 and z.dtype == torch.int32
        assert float(s) == np.float32(es), (lo, hi)
        assert int(z) == ez, (lo, hi)


def test_minmax_equals_aminmax_and_per_channel_shapes():
    gen = torch.Generator().manual_seed(0)
    obs = MinMaxObserver("int8")
    pc = MinMaxObserver("int8", F.per_channel(1))
    pg = MinMaxObserver("int4", F.per_group(1, 4))
    xs = [torch.randn(4, 8, 5, generator=gen) * (i + 1) for i in range(3)]
    for x in xs:
        obs(x), pc(x), pg(x)
    allx = torch.cat(xs)
    lo, hi = torch.aminmax(allx)
    assert obs.min_val == lo and obs.max_val == hi
    clo, chi = torch.aminmax(allx.transpose(0, 1).reshape(8, -1), dim=1)
    assert torch.equal(pc.min_val, clo) and torch.equal(pc.max_val, chi)
    assert pc.calculate_qparams()[0].shape == (8,)
    # per group on one tensor: exact
    one = MinMaxObserver("int4", F.per_group(1, 4))
    one(xs[0])
    glo, ghi = torch.aminmax(xs[0].reshape(4, 2, 4, 5), dim=2)
    assert torch.equal(one.min_val, glo) and torch.equal(one.max_val, ghi)
    assert one.calculate_qparams()[0].shape == F.per_group(1, 4).scale_shape(xs[0].shape)


def test_moving_average_equals_float64_recurrence():
    gen = torch.Generator().manual_seed(1)
    c = 0.1
    obs = MovingAverageMinMaxObserver("int8", averaging_constant=c)
    lo = hi = None
    for i in range(20):
        x = torch.randn(100, generator=gen) * (1 + i % 3)
        obs(x)
        blo, bhi = float(x.min()), float(x.max())
        lo = blo if lo is None else lo + c * (blo - lo)
        hi = bhi if hi is None else hi + c * (bhi - hi)
    assert math.isclose(float(obs.min_val), lo, rel_tol=1e-5) and math.isclose(float(obs.max_val), hi, rel_tol=1e-5)


@pytest.mark.parametrize("name", list(OBSERVERS))
def test_nonfinite_excluded_and_counted(name):
    obs = make_observer(name, "int8", F.PER_TENSOR, symmetric=True)
    x = torch.randn(1000)
    y = x.clone()
    y[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan"), float("inf")])
    obs(y)
    assert int(obs.nonfinite_count) == 5
    s, z = obs.calculate_qparams()
    assert torch.isfinite(s) and s > 0
    ref = make_observer(name, "int8", F.PER_TENSOR, symmetric=True)
    ref(x[5:])
    assert float(s) == pytest.approx(float(ref.calculate_qparams()[0]), rel=1e-6)


@pytest.mark.parametrize("name", list(OBSERVERS))
@pytest.mark.parametrize("value", [0.0, 3.5, -2.0])
def test_constant_and_zero_tensors_get_positive_scale(name, value):
    for gran in (F.PER_TENSOR, F.per_channel(0)):
        obs = make_observer(name, "uint8", gran, symmetric=False)
        obs(torch.full((4, 16), value))
        s, z = obs.calculate_qparams()
        assert bool((s > 0).all()) and bool(torch.isfinite(s).all())
        # the constant is representable within half a step
        q = F.fake_quantize(torch.full((4, 16), value), "uint8", s, z, gran)
        assert float((q - value).abs().max()) <= float(s.max()) / 2 + 1e-6


def test_all_nonfinite_gets_valid_scale():
    obs = MinMaxObserver("int8")
    obs(torch.full((10,), float("nan")))
    s, _ = obs.calculate_qparams()
    assert float(s) == 1.0


@pytest.mark.parametrize("symmetric", [True, False])
def test_percentile_within_one_bin_of_numpy(symmetric):
    gen = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(50000, generator=gen), torch.randn(50000, generator=gen) * 0.3 + 1])
    p = 99.5
    obs = PercentileObserver("int8", symmetric=symmetric, percentile=p, bins=2048)
    for chunk in x.split(25000):
        obs(chunk)
    lo, hi = obs._range()
    width = float(obs.hist_max - obs.hist_min) / obs.bins
    a = x.numpy()
    if symmetric:
        t = np.percentile(np.abs(a), p)
        assert abs(float(hi) - t) <= width and float(lo) == -float(hi)
    else:
        tail = (100 - p) / 2
        assert abs(float(hi) - np.percentile(a, 100 - tail)) <= width
        assert abs(float(lo) - np.percentile(a, tail)) <= width


def _mse(x, obs):
    s, z = obs.calculate_qparams()
    return float(((F.fake_quantize(x, obs.fmt, s, z) - x) ** 2).mean())


def test_mse_error_not_above_minmax_on_heavy_tails():
    torch.manual_seed(3)  # the sample below uses the global generator
    x = torch.distributions.StudentT(2.0).sample((200_000,))
    for fmt in ("int8", "int4"):
        mse, mm = MSEObserver(fmt), MinMaxObserver(fmt)
        mse(x), mm(x)
        assert _mse(x, mse) <= _mse(x, mm)
        assert float(mse.calculate_qparams()[0]) < float(mm.calculate_qparams()[0])  # it clipped


def test_kl_clips_outliers_on_laplace():
    torch.manual_seed(4)
    x = torch.distributions.Laplace(0.0, 1.0).sample((200_000,))
    kl, mm = KLObserver("int8"), MinMaxObserver("int8")
    kl(x), mm(x)
    t = float(kl.calculate_qparams()[0]) * 127
    amax = float(x.abs().max())
    assert 3.0 < t < 0.9 * amax, (t, amax)


@pytest.mark.parametrize("name,gran", [("minmax", F.per_channel(1)), ("moving_average", F.per_channel(0)),
                                       ("percentile", F.PER_TENSOR), ("kl", F.PER_TENSOR), ("mse", F.PER_TENSOR),
                                       ("mse", F.per_channel(1)), ("minmax", F.per_group(1, 2))])
def test_state_dict_round_trip_into_fresh_observer(name, gran):
    gen = torch.Generator().manual_seed(5)
    obs = make_observer(name, "int8", gran, symmetric=True)
    for _ in range(3):
        obs(torch.randn(6, 4, generator=gen))
    sd = obs.state_dict()
    fresh = make_observer(name, "int8", gran, symmetric=True)
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    a = obs.calculate_qparams()
    if name == "mse" and gran.axis is not None:
        # its search runs on the last tensor seen, which is not state: it says so, then recovers
        with pytest.raises(RuntimeError, match="observe a tensor"):
            fresh.calculate_qparams()
        last = obs._last
        obs(last), fresh(last)
        a = obs.calculate_qparams()
    b = fresh.calculate_qparams()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_no_data_error_and_empty_tensor():
    obs = MinMaxObserver("int8")
    with pytest.raises(RuntimeError, match="MinMaxObserver has seen no data"):
        obs.calculate_qparams()
    with pytest.raises(ValueError, match="empty tensor"):
        obs(torch.empty(0, 3))
