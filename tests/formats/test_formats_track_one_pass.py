"""``dal_track_fq_forward``'s one pass over x (a running min / max observer, out of place): each
chunk's extremes and its fake quantization with the parameters of a batch inside the running
range, a second pass only when the step's real parameters differ. Forced against the two-pass route
(the same C call in place, which never speculates) on the same inputs: outputs, masks, observer
buffers, scale and zero point bit for bit, for batches inside the range (the guess holds) and
leaving it (the guess fails), with ties, saturation, the int16 / int8 bounds, one and two threads;
a NaN or a zero extreme is refused by both, nothing written. The torch path's equality with the
kernel is tests/formats/test_formats_track.py and tests/test_quantizer_fast_path.py."""
import zlib

import pytest
import torch

from dal.formats import FORMATS, native
from dal.formats.fused import kernel_mode
from dal.formats.qparams import code_range
from dal.formats.track import step_args

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

N = 3 * 16384 + 13  # several chunks of the kernel (16384 elements) and a tail


def _run(x, fmt, symmetric, lo, hi, in_place, threads):
    """One call; returns (ok, out, mask, buffers) with the running range (lo, hi) as the observer's."""
    q = FORMATS[fmt]
    qmin, qmax = code_range(q, False)
    mn, mx, seen = torch.tensor(lo), torch.tensor(hi), torch.tensor(3)
    scale, zp = torch.tensor(0.5), torch.tensor(7, dtype=torch.int32)
    src = x.clone()
    out = src if in_place else torch.full_like(x, 12345.0)
    mask = torch.zeros((x.numel() + 7) // 8, dtype=torch.uint8)
    ok = native.library().dal_track_fq_forward(src.data_ptr(), out.data_ptr(), mask.data_ptr(), x.numel(),
                                               mn.data_ptr(), mx.data_ptr(), seen.data_ptr(),
                                               *step_args(None, q, symmetric, qmin, qmax), scale.data_ptr(),
                                               zp.data_ptr(), kernel_mode(q), threads)
    return ok, out, mask, (mn, mx, seen, scale, zp), src


def _both(x, fmt, symmetric, lo, hi, threads):
    one = _run(x, fmt, symmetric, lo, hi, False, threads)
    two = _run(x, fmt, symmetric, lo, hi, True, threads)
    assert one[0] == two[0]
    assert torch.equal(one[4].view(torch.int32), x.view(torch.int32)), "the input was written"
    for a, b in zip(one[3], two[3]):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b)
    if one[0]:
        assert torch.equal(one[1].view(torch.int32), two[1].view(torch.int32))
        assert torch.equal(one[2], two[2])
    return one


def _ties(s, codes, gen):
    """N values: codes k + 0.5 and the given codes (times s), shuffled, and random values between."""
    x = (torch.rand(N, generator=gen) * 2 - 1) * float(codes.abs().max()) * s
    pos = torch.randperm(N, generator=gen)[:2 * codes.numel()]
    x[pos[:codes.numel()]] = codes * s
    x[pos[codes.numel():]] = (torch.round(codes / 2) + 0.5) * s
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt,symmetric", [("int16", True), ("int8", True), ("uint8", False), ("int8", False)])
def test_inside_the_range_one_pass_equals_two(fmt, symmetric, threads):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}{symmetric}".encode()))
    lo, hi = -3.0, 5.0
    qmin, qmax = code_range(FORMATS[fmt], False)
    one = _both(torch.rand(N, generator=gen) * 8 - 3, fmt, symmetric, lo, hi, threads)  # inside: the guess holds
    assert one[0] and float(one[3][0]) == lo and float(one[3][1]) == hi
    s = float(one[3][3])
    zp = int(one[3][4])
    # ties and the format's bounds (k_lo = qmin - zp, k_hi = qmax - zp) and past them, all inside [lo, hi]
    codes = torch.tensor([qmin - zp, qmax - zp, qmin - zp + 1, qmax - zp - 1, 0, 1, -1], dtype=torch.float32)
    x = _ties(s, codes, gen).clamp(lo, hi)
    x[:2] = torch.tensor([lo, hi])
    assert _both(x, fmt, symmetric, lo, hi, threads)[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt,symmetric", [("int16", True), ("int8", True), ("uint8", False)])
@pytest.mark.parametrize("where", ["below", "above", "both", "last_chunk"])
def test_leaving_the_range_takes_the_second_pass(fmt, symmetric, where, threads):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt}{where}".encode()))
    x = torch.rand(N, generator=gen) * 2 - 1  # inside [-1, 1.5]
    if where in ("below", "both"):
        x[17] = -4.0
    if where in ("above", "both"):
        x[20000] = 6.5
    if where == "last_chunk":
        x[N - 2] = 9.0
    one = _both(x, fmt, symmetric, -1.0, 1.5, threads)
    assert one[0]
    if where != "above" and where != "last_chunk":
        assert float(one[3][0]) == -4.0
    # the guess (the parameters of a batch inside [-1, 1.5]) was wrong: the second pass was needed
    guess = _run(torch.rand(N, generator=gen) * 2.5 - 1, fmt, symmetric, -1.0, 1.5, False, threads)
    assert guess[0] and float(guess[3][3]) != float(one[3][3])


@pytest.mark.parametrize("bad", ["nan", "zero_min", "zero_max", "inf"])
def test_refused_by_both_routes_nothing_written(bad):
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(N, generator=gen) + 0.5
    if bad == "nan":
        x[100] = float("nan")
    elif bad == "zero_min":
        x[200] = 0.0
    elif bad == "zero_max":
        x = -x
        x[300] = -0.0
    else:
        x[400] = float("inf")
    one = _both(x, "int16", True, -2.0, 2.0, 1)
    assert not one[0]
    mn, mx, seen, scale, zp = one[3]
    assert (float(mn), float(mx), int(seen), float(scale), int(zp)) == (-2.0, 2.0, 3, 0.5, 7)
