"""dal/convert/codes_boundary.py's per-tensor integer KV quantizers with constants made once: the past
codes' DequantizeLinear and the new entries' QuantizeLinear give dal.formats' ``dequantize`` /
``quantize`` bit for bit (int8, uint8 with a zero point, int4; NaN, +-inf, -0, ties, values beyond the
range, every code), and follow a scale or zero point written after the first call; FP8 and per-channel
quantizers take dal.formats' functions.

Oracle: dal.formats' ``quantize`` / ``dequantize`` (ONNX Q/DQ, themselves checked against onnx.reference
in tests/formats), called with the quantizer's parameters as ``CodesStep`` calls them.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dal.convert.codes_boundary import IntegerCodesStep
from dal.formats import dequantize, per_channel, quantize
from dal.quantizer import FakeQuantizer

#: a float32 scale for which a true division and a multiplication by its reciprocal round many of
#: _values' half steps differently (178 for k in [-100, 100); found with numpy, IEEE float32: the same on every CPU)
SCALE = 0.025307653471827507


def _boundary() -> IntegerCodesStep:
    """An IntegerCodesStep with no decoder: its per-quantizer DQ / Q only (they read nothing else)."""
    b = IntegerCodesStep.__new__(IntegerCodesStep)
    nn.Module.__init__(b)
    return b


def _quantizer(fmt: str, scale: float, zp: int, gran=None) -> FakeQuantizer:
    q = FakeQuantizer(fmt, granularity=gran) if gran is not None else FakeQuantizer(fmt)
    shape = (2,) if gran is not None else ()
    q.set_qparams(torch.full(shape, scale), torch.full(shape, zp, dtype=torch.int32))
    return q


def _values(scale: float) -> torch.Tensor:
    """Edge values, random ones across and beyond the range, and the float32 values at and one ulp either
    side of each half step ``(k + 0.5) * scale``: where a true division and a multiplication by
    ``1 / scale`` round differently (SCALE: 14 of them inside int4's range)."""
    g = torch.Generator().manual_seed(0)
    edge = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30, -1e30])
    ties = ((torch.arange(-200, 200, dtype=torch.float64) + 0.5) * scale).float()
    near = torch.cat([torch.nextafter(ties, ties * 2), ties, torch.nextafter(ties, torch.zeros(()))])
    return torch.cat([edge, near, torch.randn(200, generator=g) * 300 * scale]).reshape(1, 1, -1, 1)


def _want(q, x=None, c=None):
    s, zp = q.effective_qparams()
    if x is not None:
        return quantize(x, q.fmt, s.float(), zp, q.granularity)
    return dequantize(c, q.fmt, s.float(), zp, q.granularity)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32),
                       b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32))  # bits, -0 included


@pytest.mark.parametrize("fmt,zp", [("int8", 0), ("int8", -7), ("uint8", 128), ("int4", 0), ("int4", 3)])
def test_constants_equal_dal_formats_and_follow_new_parameters(fmt, zp):
    b, q = _boundary(), _quantizer(fmt, SCALE, zp)
    x = _values(SCALE)
    lo, hi = q.qmin, q.qmax
    codes = torch.arange(lo, hi + 1, dtype=torch.float32).to(q.fmt.torch_dtype()).reshape(1, 1, -1, 1)
    for _ in range(2):  # the first call makes the constants (through dal.formats), the second uses them
        _same(b._quantize(q, x), _want(q, x=x))
        _same(b._dequantize(q, codes), _want(q, c=codes))
    assert b._constants(q)  # made
    q.set_qparams(torch.tensor(0.1), torch.tensor(zp // 2, dtype=torch.int32))  # written after: constants stale
    assert b._constants(q) is False
    for _ in range(2):
        _same(b._quantize(q, x), _want(q, x=x))
        _same(b._dequantize(q, codes), _want(q, c=codes))
    with torch.no_grad():
        q.scale.mul_(2.0)  # in place: the version changes
    _same(b._quantize(q, x), _want(q, x=x))
    _same(b._dequantize(q, codes), _want(q, c=codes))


@pytest.mark.parametrize("fmt,gran", [("fp8_e4m3", None), ("int8", per_channel(1))])
def test_other_quantizers_take_dal_formats(fmt, gran):
    b = _boundary()
    q = _quantizer(fmt, 0.05, 0, gran) if gran is not None else FakeQuantizer(fmt)
    if gran is None:
        q.set_qparams(torch.tensor(0.05), torch.tensor(0, dtype=torch.int32))
    x = torch.randn(1, 2, 5, 3) * 4
    _same(b._quantize(q, x), _want(q, x=x))
    assert b._constants(q) is None


def test_a_refused_scale_is_never_kept():
    """A scale dal.formats refuses (0) raises on every call: no constants are kept from it."""
    b, q = _boundary(), _quantizer("int8", 0.05, 0)
    x = torch.randn(1, 1, 4, 2)
    _same(b._quantize(q, x), _want(q, x=x))
    with torch.no_grad():
        q.scale.fill_(0.0)
    for _ in range(2):
        with pytest.raises(ValueError):
            b._quantize(q, x)
        with pytest.raises(ValueError):
            b._dequantize(q, torch.zeros(1, 1, 4, 2, dtype=torch.int8))
    assert b._constants(q) is False
