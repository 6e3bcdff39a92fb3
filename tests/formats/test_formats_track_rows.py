"""``track.rows_track_fake_quantize``: a quantizer with one scale per row (per channel along axis 0, a
weight's output channels; per group of the last axis) in one C++ call, forced against the route it
replaces on the same inputs and copies of the same buffers (``fold.scale_extremes`` +
``track_qparams`` + ``FusedFakeQuantizeFunction``): outputs, input gradients (the masks), observer
buffers, scale and zero point bit for bit, with ties, saturation, the int8 / int16 bounds, running
min / max and moving average, one and two threads; a NaN, a zero or an infinite extreme is refused
by both routes with nothing written. The torch path's equality is tests/test_quantizer_fast_path.py."""
import zlib

import pytest
import torch

from dal.formats import FORMATS, native, per_channel, per_group
from dal.formats.fold import scale_extremes
from dal.formats.fused import FusedFakeQuantizeFunction, KernelOutputFunction, kernel_layout
from dal.formats.qparams import code_range
from dal.formats.track import rows_track_fake_quantize, track_qparams

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}threads")
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _buffers(rows, ema):
    lo = -2.0 - torch.arange(rows, dtype=torch.float32) / 8
    return dict(min_val=lo.clone(), max_val=(-lo * 1.5).clone(), batches_seen=torch.tensor(4), ema=ema,
                scale=torch.ones(rows), zero_point=torch.zeros(rows, dtype=torch.int32))


def _routes(x, gran, fmt, symmetric, ema):
    """(new, old): each (output or None, input gradient, buffers) from copies of the same buffers."""
    q = FORMATS[fmt]
    qmin, qmax = code_range(q, False)
    lay = kernel_layout(x, gran)
    results = []
    for new in (True, False):
        b = _buffers(lay[0], ema)
        step = (b["min_val"], b["max_val"], b["batches_seen"], b["ema"], q, symmetric, qmin, qmax)
        xr = x.detach().clone().requires_grad_()
        if new:
            done = rows_track_fake_quantize(xr, lay, *step, b["scale"], b["zero_point"], True)
            y = None if done is None else KernelOutputFunction.apply(xr, done)
        else:
            ext = scale_extremes(xr, gran)
            kp = None if ext is None else track_qparams(*ext, *step, b["scale"], b["zero_point"])
            y = None if kp is None else FusedFakeQuantizeFunction.apply(xr, b["scale"], b["zero_point"], q, gran,
                                                                          qmin, qmax, kp)
        grad = None
        if y is not None:
            y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
            grad = xr.grad
        results.append((y, grad, b))
    return results


def _check(new, old):
    (ya, ga, ba), (yb, gb, bb) = new, old
    assert (ya is None) == (yb is None)
    if ya is not None:
        assert torch.equal(ya.detach().view(torch.int32), yb.detach().view(torch.int32))
        assert torch.equal(ga.view(torch.int32), gb.view(torch.int32))
    for k in ("min_val", "max_val", "batches_seen", "scale", "zero_point"):
        assert torch.equal(ba[k], bb[k]), k
    return ya, ba


def _weight(rows, row_len, gen, s_rows):
    """rows x row_len: random values, ties (k + 0.5) * s and codes past the bounds of each row's scale."""
    x = torch.randn(rows, row_len, generator=gen)
    for r in range(rows):
        s = float(s_rows[r])
        x[r, :6] = torch.tensor([0.5, 1.5, -2.5, 126.5, -127.5, 3.5]) * s
    return x


@pytest.mark.parametrize("fmt,symmetric", [("int8", True), ("int16", True), ("uint8", False), ("int4", True)])
@pytest.mark.parametrize("ema", [None, 0.25])
def test_per_channel_rows_equal_the_old_route(fmt, symmetric, ema, threads):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}{ema}".encode()))
    rows = 6
    b = _buffers(rows, ema)
    s_rows = torch.maximum(-b["min_val"], b["max_val"]) / 127
    for shape in ((rows, 37), (rows, 3, 3, 3), (rows, 9000)):
        x = _weight(rows, int(torch.tensor(shape[1:]).prod()), gen, s_rows).reshape(shape)
        y, bufs = _check(*_routes(x, per_channel(0), fmt, symmetric, ema))
        assert y is not None and int(bufs["batches_seen"]) == 5
        wide = x * 40  # leaves the running range: the scales move
        _check(*_routes(wide, per_channel(0), fmt, symmetric, ema))


def test_per_group_rows_equal_the_old_route(threads):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen)
    y, _ = _check(*_routes(x, per_group(-1, 16), "int4", True, None))
    assert y is not None


@pytest.mark.parametrize("bad", ["nan", "zero_extreme", "inf"])
def test_refused_by_both_routes(bad):
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(5, 40, generator=gen) + 0.5
    if bad == "nan":
        x[2, 7] = float("nan")
    elif bad == "zero_extreme":
        x[3, 9] = 0.0  # the row's minimum is zero
    else:
        x[1, 1] = float("inf")
    y, bufs = _check(*_routes(x, per_channel(0), "int8", True, None))
    assert y is None and int(bufs["batches_seen"]) == 4 and torch.equal(bufs["scale"], torch.ones(5))
