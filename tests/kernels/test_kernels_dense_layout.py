"""dal::fake_quantize per tensor, and per channel on axis 0 (a channels-last conv weight), on a
channels-last (dense, not contiguous) input: the C++ kernel takes it (no copy, no generic path),
over the memory order, and gives the bits of the
same values laid out contiguous: output (with x's strides), packed mask (x's memory order, as the
generic implementation packs it) and the straight-through gradient, the oracle being the op on the
contiguous copy and the generic plain-torch implementation."""
import pytest
import torch

import dal.kernels.fake_quant as FQ
from dal.formats import FORMATS, PER_TENSOR, native, per_channel
from dal.formats.qparams import code_range

from kernels_common import assert_bits_equal

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C++ compiler: the kernel is not built")


def _x():
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 5, 4, 3, generator=g) * 40).round() / 4 + 0.125  # many exact ties at scale 0.25
    x[0, 0, 0, :3] = torch.tensor([1e30, -1e30, -0.0])
    x[1, 4, 3, 2] = float("nan")
    return x


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("fmt", ["int8", "uint8", "fp8_e4m3"])
def test_channels_last_equals_contiguous(fmt, axis):
    f = FORMATS[fmt]
    qmin, qmax, mode = (-f.max_value, f.max_value, FQ.FP8_MODES[fmt]) if f.is_float8 \
        else (*map(float, code_range(f, False)), 0)
    x = _x()
    xc = x.contiguous(memory_format=torch.channels_last)
    assert not xc.is_contiguous()
    if axis == 1:  # channels-last activations per channel: not one block per channel, the generic path
        assert FQ.kernel_layout(xc, axis, 0) is None
    else:
        assert FQ.kernel_layout(xc, axis, 0) == FQ.kernel_layout(x, axis, 0)
    n = 1 if axis is None else x.shape[axis]
    s = torch.linspace(0.25, 0.5, n) if axis is not None else torch.tensor(0.25)
    zp = torch.full(s.shape, 3 if not f.signed else 0, dtype=torch.int32)
    gran = PER_TENSOR if axis is None else per_channel(axis)
    y_ref, m_ref = FQ.cpu_kernel(x, s, zp, qmin, qmax, axis, 0, mode, True)
    y_cl, m_cl = FQ.generic(xc, s, zp, qmin, qmax, axis, 0, mode, True) if axis == 1 \
        else FQ.cpu_kernel(xc, s, zp, qmin, qmax, axis, 0, mode, True)
    assert y_cl.stride() == xc.stride()
    assert_bits_equal(y_cl, y_ref, "channels-last vs contiguous")
    gen_y, gen_m = FQ.generic(xc, s, zp, qmin, qmax, axis, 0, mode, True)
    assert_bits_equal(y_cl, gen_y, "kernel vs generic")
    assert torch.equal(m_cl, gen_m)  # the mask in x's memory order, both implementations
    # the STE gradient through the op (C++ forward and backward), channels-last vs contiguous
    t = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for xi, ti in ((x, t), (xc, t.contiguous(memory_format=torch.channels_last)), (xc, t)):
        xi = xi.clone().requires_grad_()
        y = FQ.fake_quantize(xi, s, zp, f, gran)
        y.backward(ti)
        grads.append(xi.grad)
    assert not torch.equal(grads[0], t)  # something was clipped: the mask matters
    for g in grads[1:]:
        assert torch.equal(torch.nan_to_num(g).view(torch.int32), torch.nan_to_num(grads[0]).view(torch.int32))
