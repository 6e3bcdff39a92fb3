"""dal::fake_quantize_lsq (LSQ / LSQ+ as a registered op) against the eager LSQ function
(dal.formats.autograd.FakeQuantizeFunction, whose forward is tested against onnx.reference in
tests/formats): output and d/dx bit for bit, every format (INT and FP8) and granularity, edge values
(ties, -0.0, saturation) included; d/dscale and d/dzero_point against the exact float64 sums of the
same float32 products within the op's contract (the eager function sums in float32; the op in
float64, rounded once: dal.kernels.lsq); the scale's gradient also against LSQ's formula in float64
(numpy). The CPU kernels against the plain-torch form: test_kernels_lsq_cpu.py."""
import numpy as np
import pytest
import torch

from dal.formats import PER_TENSOR, get_format, per_channel
from dal.formats.autograd import FakeQuantizeFunction
from dal.kernels import fake_quantize_lsq

from kernels_common import FORMATS_Q, GRANULARITIES, assert_bits_equal, case
from lsq_oracle import assert_within, exact_sums, lsq_terms

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
        eager, op = _grads(y1, x1, s1, z1, seed), _grads(y2, x2, s2, z2, seed)
        assert [a is None for a in eager] == [b is None for b in op]
        assert_bits_equal(eager[0], op[0], f"{fmt.name} {gid} d/dx")
        g = torch.randn(y1.shape, generator=torch.Generator().manual_seed(seed)).numpy()
        se, ze = (np.asarray(gran.expand(t.detach(), shape).expand(shape)) for t in (s1, z1))
        _, ts, tz = lsq_terms(fmt, x1.detach().numpy(), se, ze, g)
        groups = np.asarray(gran.expand(torch.arange(s1.numel()).reshape(s1.shape), shape).expand(shape))
        assert_within(op[1], *exact_sums(ts, groups, GRAD_SCALE), f"{fmt.name} {gid} d/dscale")
        if op[2] is not None:
            assert_within(op[2], *exact_sums(tz, groups, GRAD_SCALE), f"{fmt.name} {gid} d/dzero_point")


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


def test_learnable_quantizer_bfloat16_input():
    """A learnable FakeQuantizer fed bfloat16 (autocast) takes dal::fake_quantize_lsq: scale and
    rounding in float32, output bfloat16 = the float32 step's output on the same (widened) values
    rounded once to bfloat16; the scale's gradient is the float32 step's of the same upstream gradient (the same float32 products
summed in float64 by the plain-torch form and by the C++ pass: within one float32 ulp of each other)."""
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
    s32 = q.scale.grad
    assert_within(s16, s32, np.spacing(np.abs(s32.numpy())), "bf16 vs float32 d/dscale")
    assert (s16 != 0).all()
