"""dal::fake_quantize_lsq (LSQ / LSQ+ as a registered op) against the eager LSQ path
(dal.formats.autograd.FakeQuantizeFunction, whose forward is tested against onnx.reference in
tests/formats): output, d/dx, d/dscale and d/dzero_point bit for bit, every format (INT and FP8)
and granularity, edge values (ties, -0.0, saturation) included; the scale's gradient also against
LSQ's formula in float64 (numpy)."""
import numpy as np
import pytest
import torch

from dal.formats import PER_TENSOR, get_format, per_channel
from dal.formats.autograd import FakeQuantizeFunction
from dal.kernels import fake_quantize_lsq

from kernels_common import FORMATS_Q, GRANULARITIES, assert_bits_equal, case

GRAD_SCALE = 0.0371


def _inputs(fmt, shape, gran, seed):
    x, scale, zp = case(fmt, shape, gran, seed=seed)
    sshape = gran.scale_shape(shape)
    x = torch.from_numpy(x).requires_grad_()
    s = torch.from_numpy(scale).reshape(sshape).requires_grad_()
    affine = fmt.is_integer and not fmt.signed
    # LSQ+: a float zero point a little off its integer, learnable for affine formats
    z = torch.from_numpy(zp).reshape(sshape).float() + (0.3 if affine else 0.0)
    return x, s, z.clamp(fmt.qmin, fmt.qmax).requires_grad_(affine)


def _grads(y, x, s, z, seed):
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    y.backward(g)
    return x.grad, s.grad, z.grad


@pytest.mark.parametrize("fmt", FORMATS_Q, ids=lambda f: f.name)
@pytest.mark.parametrize("gid,shape,gran,axis,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_lsq_op_is_eager_lsq(fmt, gid, shape, gran, axis, block):
    for seed in (0, 1):
        x1, s1, z1 = _inputs(fmt, shape, gran, seed)
        x2, s2, z2 = (t.detach().clone().requires_grad_(t.requires_grad) for t in (x1, s1, z1))
        y1 = FakeQuantizeFunction.apply(x1, s1, z1, fmt, gran, fmt.qmin, fmt.qmax, GRAD_SCALE)
        y2 = fake_quantize_lsq(x2, s2, z2, fmt, gran, grad_scale=GRAD_SCALE)
        assert_bits_equal(y1, y2, f"{fmt.name} {gid} output")
        for name, a, b in zip(("x", "scale", "zero_point"), _grads(y1, x1, s1, z1, seed),
                              _grads(y2, x2, s2, z2, seed)):
            assert (a is None) == (b is None), name
            if a is not None:
                assert_bits_equal(a, b, f"{fmt.name} {gid} d/d{name}")


def test_scale_gradient_is_lsq_formula_float64():
    """d/ds = g * sum(where(in range, c - v, c)) per channel, with c the clipped code; float64 oracle."""
    torch.manual_seed(3)
    x = torch.randn(3, 5, 7) * 4
    s = torch.tensor([0.02, 0.05, 0.1]).requires_grad_()
    fake_quantize_lsq(x, s, None, "int8", per_channel(0), grad_scale=GRAD_SCALE).sum().backward()
    v = x.double().numpy() / s.detach().double().numpy()[:, None, None]
    r = np.round(v)
    c = np.clip(r, -128, 127)
    want = GRAD_SCALE * np.where((r >= -128) & (r <= 127), c - v, c).sum(axis=(1, 2))
    np.testing.assert_allclose(s.grad.double().numpy(), want, rtol=1e-5)
    assert (np.abs(v) > 128).any() and (np.abs(v) < 127).any()  # both branches taken


def test_projection_is_straight_through():
    """A scale below MIN_SCALE and a zero point outside the code range are used projected, their
    gradients passed through to the raw values (what the eager quantizer does after projecting in place)."""
    from dal.formats.qparams import MIN_SCALE
    x = torch.tensor([0.5, -3.0, 2.0])
    s = torch.tensor(-1.0, requires_grad=True)
    z = torch.tensor(300.0, requires_grad=True)
    y = fake_quantize_lsq(x, s, z, "uint8")
    s_ref = torch.tensor(MIN_SCALE, requires_grad=True)
    z_ref = torch.tensor(255.0, requires_grad=True)
    y_ref = FakeQuantizeFunction.apply(x, s_ref, z_ref, get_format("uint8"), PER_TENSOR, 0, 255, 1.0)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(s.grad, s_ref.grad) and torch.equal(z.grad, z_ref.grad)


def test_opcheck():
    """torch.library.opcheck: schema, fake kernel, autograd registration, AOT dispatch."""
    x = torch.randn(4, 6, requires_grad=True)
    s = torch.full((4,), 0.02).requires_grad_()
    z = torch.full((4,), 3.2).requires_grad_()
    torch.library.opcheck(torch.ops.dal.fake_quantize_lsq.default,
                          (x, s, z, -128.0, 127.0, 0, 0, 0, 0.1, True, True))


def test_learnable_quantizer_bfloat16_input():
    """A learnable FakeQuantizer fed bfloat16 (autocast) takes dal::fake_quantize_lsq: scale and
    rounding in float32, output bfloat16 = the float32 step's output on the same (widened) values
    rounded once to bfloat16; the scale's gradient is the float32 step's of the same upstream gradient."""
    from dal.quantizer import FakeQuantizer
    torch.manual_seed(4)
    q = FakeQuantizer("int8", per_channel(0), learnable=True)
    xb = (torch.randn(6, 20) * 3).to(torch.bfloat16)
    q(xb.float())
    q.end_observation("quantize")
    q.scale.data.mul_(0.5)  # some values clip
    x16 = xb.clone().requires_grad_()
    y16 = q(x16)
    assert y16.dtype == torch.bfloat16
    g = torch.randn(6, 20).to(torch.bfloat16)
    y16.backward(g)
    s16 = q.scale.grad.clone()
    q.scale.grad = None
    y32 = q(xb.float().requires_grad_())
    assert torch.equal(y16, y32.to(torch.bfloat16))
    y32.backward(g.float())
    assert torch.equal(s16, q.scale.grad) and (s16 != 0).all()
