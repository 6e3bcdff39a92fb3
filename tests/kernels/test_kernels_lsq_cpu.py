"""dal::fake_quantize_lsq's CPU kernels (the fake-quant C++ forward without a mask, the C++ LSQ
backward of csrc/lsq.cpp) against its plain-torch form on the same inputs: output and d/dx bit for
bit (ties, -0.0, saturation, NaN / inf, per tensor, per channel on axis 0 and 1, blocks,
non-contiguous and channels-last input); d/dscale and d/dzero_point of both forms against an exact
float64 numpy sum (tests/kernels/lsq_oracle.py) within the contract's bound (dal.kernels.lsq: one
float32 ulp plus the float64 summation error); under torch.compile both ops trace with no graph break."""
import zlib

import numpy as np
import pytest
import torch

from dal.formats import PER_TENSOR, per_channel
from dal.formats.qparams import MIN_SCALE
from dal.kernels import fake_quantize_lsq, lsq, lsq_kernel
from dal.kernels.fake_quant import op_format_args

from kernels_common import FORMATS_Q, GRANULARITIES, assert_bits_equal, case
from lsq_oracle import assert_within, exact_sums, lsq_terms

pytestmark = pytest.mark.skipif(lsq_kernel.library() is None, reason=f"C++ kernel unavailable: {lsq_kernel.status()}")

GS = 0.0371


def _inputs(fmt, shape, gran, seed, nonfinite=False):
    """x, scale and an LSQ+ zero point (float, off its integer for affine formats), g; torch float32."""
    x, scale, zp = case(fmt, shape, gran, seed=seed, nonfinite=nonfinite)
    sshape = gran.scale_shape(shape)
    z = torch.from_numpy(zp).reshape(sshape).float() + (0.3 if fmt.is_integer and not fmt.signed else 0.0)
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return torch.from_numpy(x), torch.from_numpy(scale).reshape(sshape), z, g


def _args(fmt, gran, x):
    mode, qmin, qmax = op_format_args(fmt)
    return float(qmin), float(qmax), gran.normalized_axis(x.dim()), gran.block_size, mode


def _groups(gran, x, scale):
    """Each element's parameter index, shaped like x."""
    idx = torch.arange(scale.numel()).reshape(scale.shape)
    return np.asarray(gran.expand(idx, x.shape).expand(x.shape)) if gran.axis is not None \
        else np.zeros(x.shape, np.int64)


def _check_sums(fmt, gran, x, s, z, g, ds, dzp, tag):
    """ds / dzp against the exact sums of the contract's float32 products (s, z unprojected: in range here)."""
    se = np.asarray(gran.expand(s, x.shape).expand(x.shape)) if gran.axis is not None else s.numpy()
    ze = np.asarray(gran.expand(z, x.shape).expand(x.shape)) if gran.axis is not None else z.numpy()
    _, ts, tz = lsq_terms(fmt, x.numpy(), se, ze, g.numpy())
    groups = _groups(gran, x, s)
    assert_within(ds, *exact_sums(ts, groups, GS), f"{tag} d/dscale")
    assert_within(dzp, *exact_sums(tz, groups, GS), f"{tag} d/dzero_point")


@pytest.mark.parametrize("fmt", FORMATS_Q, ids=lambda f: f.name)
@pytest.mark.parametrize("gid,shape,gran,axis,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_cpu_kernel_is_the_generic_form(fmt, gid, shape, gran, axis, block):
    seed = zlib.crc32(f"{fmt.name}{gid}".encode()) % 1000
    x, s, z, g = _inputs(fmt, shape, gran, seed)
    a = _args(fmt, gran, x)
    y_gen = lsq.forward_generic(x, s, z, *a)
    y_cpu = lsq.forward_cpu(x, s, z, *a)
    b_gen = lsq.backward_generic(g, x, s, z, *a, GS, True, True, True)
    b_cpu = lsq.backward_cpu(g, x, s, z, *a, GS, True, True, True)
    if gid == "per_group1":  # blocks on a middle axis: no C++ layout
        assert y_cpu is None and b_cpu is None
    else:
        assert y_cpu is not None and b_cpu is not None, "the C++ path was expected to apply"
        assert_bits_equal(y_cpu, y_gen, f"{fmt.name} {gid} output")
        assert_bits_equal(b_cpu[0], b_gen[0], f"{fmt.name} {gid} d/dx")
        _check_sums(fmt, gran, x, s, z, g, b_cpu[1], b_cpu[2], f"{fmt.name} {gid} C++")
    _check_sums(fmt, gran, x, s, z, g, b_gen[1], b_gen[2], f"{fmt.name} {gid} generic")
    m, _, _ = lsq_terms(fmt, x.numpy(), *(np.asarray(gran.expand(t, x.shape).expand(x.shape)) if gran.axis is not None
                                          else t.numpy() for t in (s, z)), g.numpy())
    assert m.any() and (~m).any()  # both branches of the gradient taken
    assert_bits_equal(b_gen[0], g * torch.from_numpy(m), "d/dx is g * mask")


@pytest.mark.parametrize("fmt", [f for f in FORMATS_Q if f.name in ("int8", "uint4", "fp8_e4m3")], ids=lambda f: f.name)
def test_nonfinite_inputs(fmt):
    """NaN stays NaN with no gradient to x and a NaN scale gradient for its channel, as the plain-torch
    form; +-inf saturate (no gradient to x), in both forms."""
    gran = per_channel(0)
    x, s, z, g = _inputs(fmt, (4, 6, 10), gran, 5, nonfinite=True)
    a = _args(fmt, gran, x)
    y_cpu, y_gen = lsq.forward_cpu(x, s, z, *a), lsq.forward_generic(x, s, z, *a)
    assert_bits_equal(y_cpu, y_gen, "output")
    flat = y_cpu.reshape(-1)
    assert flat[4].isnan() and flat[5].isfinite() and flat[6].isfinite()
    b_cpu = lsq.backward_cpu(g, x, s, z, *a, GS, True, True, True)
    b_gen = lsq.backward_generic(g, x, s, z, *a, GS, True, True, True)
    assert_bits_equal(b_cpu[0], b_gen[0], "d/dx")
    assert (b_cpu[0].reshape(-1)[4:7] == 0).all()
    assert b_cpu[1][0].isnan() and b_gen[1][0].isnan() and b_cpu[1][1:].isfinite().all()
    _check_sums(fmt, gran, x, s, z, g, b_cpu[1], b_cpu[2], "C++")


@pytest.mark.parametrize("layout", ["transposed", "channels_last_axis0", "channels_last_axis1", "sliced"])
def test_non_contiguous_input(layout):
    """Dense permuted layouts the fake-quant kernel reads in memory order take the C++ pass (grad laid
    out like x); others (a sliced view, a channel axis after a permuted one, grad strides unlike x's)
    the plain-torch form. Both give the generic form's bits through the op."""
    fmt = FORMATS_Q[2]  # int4
    base, s0, z0, g0 = _inputs(fmt, (4, 6, 8, 10), PER_TENSOR, 7)
    axis = {"transposed": None, "channels_last_axis0": 0, "channels_last_axis1": 1, "sliced": 1}[layout]
    if layout == "transposed":
        x, g = base.transpose(1, 3), g0.transpose(1, 3)
    elif layout == "sliced":
        x, g = base[:, :, ::2], g0[:, :, ::2]
    else:
        x, g = base.to(memory_format=torch.channels_last), g0.to(memory_format=torch.channels_last)
    gran = PER_TENSOR if axis is None else per_channel(axis)
    s = s0 if axis is None else torch.linspace(0.5, 1.5, x.shape[axis]) * s0
    z = torch.zeros(s.shape)
    a = _args(fmt, gran, x)
    applies = layout in ("transposed", "channels_last_axis0")
    assert (lsq.backward_cpu(g, x, s, z, *a, GS, True, True, True) is not None) == applies
    assert lsq.backward_cpu(g.contiguous(), x, s, z, *a, GS, True, True, True) is None or x.is_contiguous()
    xr, sr = x.clone().requires_grad_(), s.clone().requires_grad_()
    y = fake_quantize_lsq(xr, sr, None, fmt, gran, grad_scale=GS)
    y.backward(g)
    assert_bits_equal(y, lsq.forward_generic(x, s, z, *a), f"{layout} output")
    assert y.stride() == torch.empty_like(x).stride()
    gen = lsq.backward_generic(g, x, s, z, *a, GS, True, True, False)
    assert_bits_equal(xr.grad, gen[0], f"{layout} d/dx")
    se = np.asarray(gran.expand(s, x.shape).expand(x.shape)) if axis is not None else s.numpy()
    _, ts, _ = lsq_terms(fmt, x.numpy(), se, 0.0, g.numpy())
    assert_within(sr.grad, *exact_sums(ts, _groups(gran, x, s), GS), f"{layout} d/dscale")


def test_op_dispatch_takes_the_kernels_and_projects():
    """Through the registered op (autograd, CPU dispatch): output, d/dx and d/dscale are the C++
    pass's; a scale below MIN_SCALE and a zero point outside the range are used projected, their
    gradients passed straight through."""
    fmt = FORMATS_Q[1]  # uint8
    x, s, z, g = _inputs(fmt, (3, 5, 40), per_channel(1), 11)
    s[0], z[1] = -1.0, 300.0
    xr, sr, zr = x.clone().requires_grad_(), s.clone().requires_grad_(), z.clone().requires_grad_()
    y = fake_quantize_lsq(xr, sr, zr, fmt, per_channel(1), grad_scale=GS)
    y.backward(g)
    a = _args(fmt, per_channel(1), x)
    sp, zp = s.clamp(min=MIN_SCALE), z.clamp(fmt.qmin, fmt.qmax)
    assert_bits_equal(y, lsq.forward_generic(x, sp, zp, *a), "output")
    dx, ds, dzp = lsq.backward_cpu(g, x, sp, zp, *a, GS, True, True, True)
    for got, want, name in ((xr.grad, dx, "x"), (sr.grad, ds, "scale"), (zr.grad, dzp, "zero_point")):
        assert_bits_equal(got, want, f"d/d{name}")


def test_sums_do_not_depend_on_the_thread_count():
    """The float64 partial sums are combined in a fixed order: 1 and 2 threads give the same bits
    (a per-tensor row of several 16384-element work items)."""
    fmt = FORMATS_Q[0]
    x, s, z, g = _inputs(fmt, (3, 40000), PER_TENSOR, 2)
    a = _args(fmt, PER_TENSOR, x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lsq.backward_cpu(g, x, s, z, *a, GS, True, True, True)
        torch.set_num_threads(2)
        two = lsq.backward_cpu(g, x, s, z, *a, GS, True, True, True)
    finally:
        torch.set_num_threads(threads)
    for p, q in zip(one, two):
        assert torch.equal(p, q)
    _check_sums(fmt, PER_TENSOR, x, s, z, g, one[1], one[2], "per tensor, 3 work items")


def test_opcheck():
    """torch.library.opcheck of both ops: schema, fake kernels, autograd registration, AOT dispatch."""
    x = torch.randn(4, 6, requires_grad=True)
    s = torch.full((4,), 0.02).requires_grad_()
    z = torch.full((4,), 3.2).requires_grad_()
    torch.library.opcheck(torch.ops.dal.fake_quantize_lsq.default, (x, s, z, -128.0, 127.0, 0, 0, 0, 0.1))
    torch.library.opcheck(torch.ops.dal.fake_quantize_lsq_backward.default,
                          (torch.randn(4, 6), x.detach(), s.detach(), z.detach(), 0.0, 255.0, 0, 0, 0, 0.1,
                           True, True, True))


def test_compiled_traces_without_break_and_is_eager():
    """torch.compile(fullgraph=True) of a forward + backward through the op: no graph break, and
    output and gradients equal the eager call's bit for bit (aot_eager: the ops run their CPU kernels)."""
    torch._dynamo.reset()
    fmt = FORMATS_Q[2]
    x, s, z, g = _inputs(fmt, (4, 6, 10), per_channel(1), 13)

    def forward(x, s):
        return fake_quantize_lsq(x, s, None, fmt, per_channel(1), grad_scale=GS)

    explained = torch._dynamo.explain(forward)(x.clone().requires_grad_(), s.clone().requires_grad_())
    assert explained.graph_break_count == 0, explained.break_reasons
    runs = []
    for fn in (forward, torch.compile(forward, backend="aot_eager", fullgraph=True)):
        xr, sr = x.clone().requires_grad_(), s.clone().requires_grad_()
        y = fn(xr, sr)
        y.backward(g)
        runs.append((y, xr.grad, sr.grad))
    for a, b in zip(*runs):
        assert_bits_equal(a, b)
