"""dal/convert/nan_screen.py ``holds_nan``: equal to torch's own ``torch.isnan(t).any()`` on tensors
built to defeat a sum screen: both infinities without NaN (the sum is NaN), sums that overflow to
infinity, NaN of either sign and with payloads, subnormals, empty tensors, float16 / bfloat16 /
float64 and float8 (no sum), non-contiguous views."""
from __future__ import annotations

import struct

import torch

from dal.convert.nan_screen import holds_nan


def bits_nan(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def cases():
    torch.manual_seed(0)
    base = torch.randn(64, 48)
    yield base
    yield torch.tensor([float("inf"), float("-inf"), 1.0])  # sum NaN, no NaN
    yield torch.full((1000,), 3e38)  # sum overflows to +inf
    yield torch.tensor([3e38, 3e38, -3e38, -3e38, float("inf")])
    yield torch.tensor([1.4e-45, -1.4e-45, 0.0, -0.0])
    yield torch.empty(0)
    for bits in (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF):  # quiet / negative / signalling / payload NaN
        t = base.clone()
        t[17, 5] = bits_nan(bits)
        yield t
    t = torch.tensor([float("inf"), float("-inf"), float("nan")])
    yield t
    yield base.t()[::3]  # a non-contiguous view
    nt = base.clone()
    nt[0, 47] = float("nan")
    yield nt.t()[::2]  # the NaN (row 47 of the transpose) is outside this view: False
    yield nt.t()[1::2]  # and inside this one: True
    f8 = base.clamp(-400, 400).to(torch.float8_e4m3fn)
    yield f8  # no sum for float8: the element-wise test
    f8n = f8.clone()
    f8n.view(torch.uint8)[2, 2] = 0x7F  # the E4M3FN NaN
    yield f8n
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        yield torch.full((300,), 60000.0).to(dt)  # float16: the sum overflows
        h = base.to(dt)
        h[3, 3] = float("nan")
        yield h


def test_holds_nan_equals_torch_isnan_any():
    n_true = n_false = 0
    for t in cases():
        want = bool(torch.isnan(t).any())
        assert holds_nan(t) is want, (t.dtype, t.shape)
        n_true += want
        n_false += not want
    assert n_true >= 8 and n_false >= 8  # both answers exercised
