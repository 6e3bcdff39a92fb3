"""The one-call QAT paths of dal.formats.track: ``track_fake_quantize`` (per-tensor range, observer
step and fake quantization in one C++ call) and ``fixed_fake_quantize`` (the kernel's bounds
computed in C++), against torch (``torch.aminmax``, the eager FakeQuantizeFunction) and float64.
The quantizer-level comparison with the torch path is tests/test_quantizer_fast_path.py."""
import zlib

import numpy as np
import pytest
import torch

from dal.formats import FORMATS, PER_TENSOR, fused, native, per_channel, per_group
from dal.formats.autograd import FakeQuantizeFunction
from dal.formats.qparams import code_range
from dal.formats.track import fixed_fake_quantize, track_fake_quantize
from formats_common import FP8_FORMATS, INT_FORMATS, assert_same_floats

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}threads")
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _fresh(ema=0.5):
    """Buffers of a moving-average observer before its first batch (its step copies the extremes)."""
    return dict(min_val=torch.tensor(float("inf")), max_val=torch.tensor(-float("inf")),
                batches_seen=torch.tensor(0), ema=ema)


def _step(x, fmt="uint8", symmetric=False, need_mask=True, **buffers):
    fmt = FORMATS[fmt]
    qmin, qmax = code_range(fmt, False)
    b = buffers or _fresh()
    scale, zp = torch.ones(()), torch.zeros((), dtype=torch.int32)
    done = track_fake_quantize(x, b["min_val"], b["max_val"], b["batches_seen"], b["ema"], fmt, symmetric, qmin,
                               qmax, scale, zp, need_mask)
    return done, b, scale, zp


def _with_zeros(n, gen, lo_zero, hi_zero, place):
    """n values; the minimum (lo_zero) / maximum (hi_zero) is a zero of the given sign(s)."""
    x = torch.rand(n, generator=gen) + 0.5
    if hi_zero:
        x = -x
    idx = torch.randperm(n, generator=gen)[:3] if place == "anywhere" else torch.arange(n - 3, n)
    signs = lo_zero or hi_zero
    for k, i in enumerate(idx.tolist()):
        x[i] = -0.0 if signs[k % len(signs)] == "-" else 0.0
    return x


@pytest.mark.parametrize("n", [5, 16, 43, 70001])
@pytest.mark.parametrize("place", ["anywhere", "tail"])
@pytest.mark.parametrize("signs", [("+", None), ("-", None), (None, "-"), (None, "+"), ("+-", None), (None, "-+")],
                         ids=lambda s: f"min{s[0]}_max{s[1]}")
def test_range_is_torch_aminmax_with_the_sign_of_a_zero_extreme(n, place, signs, threads):
    lo_zero, hi_zero = signs
    gen = torch.Generator().manual_seed(n)
    x = _with_zeros(n, gen, lo_zero, hi_zero, place)
    lo, hi = torch.aminmax(x)
    done, b, scale, _ = _step(x)
    both = len(lo_zero or hi_zero) == 2 and bool((_bits(x[x == 0]) != _bits(x[x == 0])[0]).any())
    if both:  # torch's sign then depends on its reduction order: the torch path must decide
        assert done is None
        assert float(b["min_val"]) == float("inf") and int(b["batches_seen"]) == 0 and float(scale) == 1.0
        return
    assert done is not None
    # the first moving-average step copies the batch's extremes: torch.aminmax's, bit for bit
    assert torch.equal(_bits(b["min_val"]), _bits(lo)) and torch.equal(_bits(b["max_val"]), _bits(hi))
    assert int(b["batches_seen"]) == 1


def test_nan_declines_and_writes_nothing():
    x = torch.randn(100)
    x[37] = float("nan")
    done, b, scale, zp = _step(x)
    assert done is None and int(b["batches_seen"]) == 0 and float(scale) == 1.0 and int(zp) == 0


def _oracle(x, s, zp, fmt):
    """float64: v = float32(x / s) (one rounding: float64 division of float32 values is exact
    enough), codes rne(v) + zp clipped to the format, out = float32(code * s); mask where no clip."""
    qmin, qmax = code_range(fmt, False)
    v = (x.double() / float(s)).float().double()
    r = torch.round(v)  # half to even
    c = torch.clamp(r, qmin - zp, qmax - zp)
    return (c * float(s)).float(), ((r >= qmin - zp) & (r <= qmax - zp)).float()


@pytest.mark.parametrize("n", [9, 4096, 70001])
def test_track_fake_quantize_against_float64_with_ties(n, threads):
    # symmetric int8 with max |x| = 127 / 16: scale = 1/16 exactly, and (k + 1/2) / 16 are ties
    gen = torch.Generator().manual_seed(n)
    k = torch.randint(-127, 127, (n,), generator=gen).double()
    x = ((k + 0.5) / 16).float()
    x[: n // 3] = (torch.randn(n // 3, generator=gen) * 3).clamp(-7, 7)
    x[0], x[-1] = 127 / 16, -127 / 16
    x = x[torch.randperm(n, generator=gen)]
    done, b, scale, zp = _step(x, "int8", symmetric=True)
    assert done is not None and float(scale) == 1 / 16 and int(zp) == 0
    out, mask, rows, row_len = done
    want, keep = _oracle(x, scale, 0, FORMATS["int8"])
    assert_same_floats(out, want, "output vs float64")
    g = torch.randn(n, generator=gen)
    xr = x.clone().requires_grad_()
    y = fused.KernelOutputFunction.apply(xr, done)
    y.backward(g)
    assert_same_floats(xr.grad, g * keep, "gradient vs float64 mask")


LAYOUTS = [  # shape, granularity
    ((70001,), PER_TENSOR),
    ((3, 7, 5, 13), PER_TENSOR),
    ((3, 7, 5, 13), per_channel(1)),
    ((6, 40), per_channel(0)),
    ((2, 3, 24), per_group(-1, 8)),
]


@pytest.mark.parametrize("shape,gran", LAYOUTS, ids=[f"{s}-{g}" for s, g in LAYOUTS])
@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS, ids=lambda f: f.name)
def test_fixed_fake_quantize_is_the_eager_path(fmt, shape, gran, threads):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt.name}{shape}{gran}".encode()))
    n = int(np.prod(shape))
    qmin, qmax = code_range(fmt, False)
    sshape = gran.scale_shape(shape)
    scale = (torch.rand(sshape, generator=gen) * 0.1 + 0.01).float()
    scale.view(-1)[0] = 0.0625  # a power of two: the ties below are exact
    zp = torch.zeros(sshape, dtype=torch.int32) if fmt.is_float8 or fmt.signed else \
        torch.randint(qmin, qmax + 1, sshape, generator=gen, dtype=torch.int32)
    x = torch.randn(n, generator=gen) * 4
    x[:64] = (torch.randint(-40, 40, (64,), generator=gen) + 0.5).float() * 0.0625
    x[64:72] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 3e38, -3e38])
    x = x.reshape(shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    done = fixed_fake_quantize(xa, fused.layout(x.shape, gran), scale, zp, fmt, qmin, qmax, True)
    assert done is not None
    ya = fused.KernelOutputFunction.apply(xa, done)
    yb = FakeQuantizeFunction.apply(xb, scale, zp, fmt, gran, qmin, qmax, 1.0)
    assert_same_floats(ya, yb, "output")
    g = torch.randn(shape, generator=gen)
    ya.backward(g)
    yb.backward(g)
    assert_same_floats(xa.grad, xb.grad, "gradient")
    # parameters the kernel does not take: the torch path decides
    assert fixed_fake_quantize(x, fused.layout(x.shape, gran), torch.ones(scale.numel() + 1), zp, fmt, qmin, qmax,
                               False) is None


@pytest.mark.parametrize("m", [0.0, -0.0, -0.75, 0.25], ids=lambda m: f"min_val={m!r}")
@pytest.mark.parametrize("n", [40, 70001])
def test_moving_average_takes_a_zero_minimum_of_both_signs(m, n, threads):
    # ReLU outputs of a residual sum hold +0 and -0 with 0 the minimum: torch.aminmax's sign is
    # then its reduction order's, but once the moving average's range is finite its step is the
    # same for either sign. The torch formula with each sign is the reference.
    gen = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=gen) * 4
    x[torch.randperm(n, generator=gen)[:6]] = torch.tensor([0.0, -0.0, 0.0, -0.0, -0.0, 0.0])
    c = 0.01
    b = dict(min_val=torch.tensor(m), max_val=torch.tensor(3.0), batches_seen=torch.tensor(5), ema=c)
    done, b, scale, zp = _step(x.clone(), fmt="uint8", symmetric=False, **b)
    assert done is not None
    hi = x.max()
    for zero in (torch.tensor(0.0), torch.tensor(-0.0)):
        mn = torch.tensor(m) + c * (zero - torch.tensor(m))
        mx = torch.tensor(3.0) + c * (hi - torch.tensor(3.0))
        assert torch.equal(_bits(b["min_val"]), _bits(mn)) and torch.equal(_bits(b["max_val"]), _bits(mx))
    assert int(b["batches_seen"]) == 6


def test_running_min_max_still_declines_a_zero_minimum_of_both_signs():
    x = torch.tensor([0.0, -0.0, 1.0, 2.0])
    done, b, scale, _ = _step(x, fmt="uint8", min_val=torch.tensor(-1.0), max_val=torch.tensor(1.0),
                              batches_seen=torch.tensor(1), ema=None)
    assert done is None and float(b["min_val"]) == -1.0 and int(b["batches_seen"]) == 1
