"""dal::fake_quantize: the C++ CPU path and the plain-torch generic path give the same bits, and both
are ONNX QuantizeLinear -> DequantizeLinear (onnx.reference and onnxruntime, optimizations off)."""
import zlib

import numpy as np
import pytest
import torch

import dal.kernels as K
from dal.formats import FORMATS, PER_TENSOR, native, per_channel, per_group
from dal.formats.qparams import code_range
from dal.kernels import fake_quant as FQ

from formats.formats_oracle import run
from kernels_common import FORMATS_Q, GRANULARITIES, assert_bits_equal, case

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"C++ kernel unavailable: {native.status()}")


def _args(fmt, gran, x, narrow=False):
    if fmt.is_float8:
        return -fmt.max_value, fmt.max_value, gran.normalized_axis(x.dim()), gran.block_size, FQ.FP8_MODES[fmt.name]
    qmin, qmax = code_range(fmt, narrow)
    return float(qmin), float(qmax), gran.normalized_axis(x.dim()), gran.block_size, 0


def _mask_oracle(fmt, x, s, zp, qmin, qmax):
    """numpy float32 division (IEEE, not torch), rint (half to even): the STE's clip mask."""
    v = np.float32(x) / np.float32(s)
    if fmt.is_float8:
        return np.abs(v) <= np.float32(fmt.max_value)
    r = np.rint(v) + zp
    return (r >= qmin) & (r <= qmax)


def _unpacked(m, x, a):
    """The op's packed mask as bool, shaped like x (a: the op's qmin, qmax, axis, block_size, mode)."""
    return FQ.unpack_mask(m, *FQ.mask_layout(x.shape, a[2], a[3]), x.shape)


def _expand(gran, a, shape):
    return np.asarray(gran.expand(torch.as_tensor(a), shape).expand(shape))


@pytest.mark.parametrize("fmt", FORMATS_Q, ids=lambda f: f.name)
@pytest.mark.parametrize("gid,shape,gran,axis,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_kernel_equals_generic_equals_onnx(fmt, gid, shape, gran, axis, block):
    x, scale, zp = case(fmt, shape, gran, seed=zlib.crc32(f"{fmt.name}{gid}".encode()) % 1000)
    xt, st, zt = torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zp)
    a = _args(fmt, gran, xt)
    gen_y, gen_m = FQ.generic(xt, st, zt, *a, True)
    kern = FQ.cpu_kernel(xt, st, zt, *a, True)
    if gid == "per_group1":
        assert kern is None  # blocks on a middle axis: no C++ layout, the generic path serves it
    else:
        assert kern is not None, "the C++ path was expected to apply"
        assert_bits_equal(kern[0], gen_y, f"kernel vs generic {fmt.name} {gid}")
        assert torch.equal(kern[1], gen_m)
    op_y = K.fake_quantize(xt, st, zt, fmt, gran)
    assert_bits_equal(op_y, gen_y, "op vs generic")
    for oracle in ("ref", "ort"):
        _, deq = run(oracle, fmt, x, scale, zp, axis, block)
        mine = gen_y.numpy()
        if oracle == "ref" and not fmt.is_float8:
            # onnx.reference casts rint(x / s) to int32 before clipping and wraps for |x / s| >= 2^31
            # (FACTS.md): those elements (the +-1e30 of the case) are checked against onnxruntime only.
            wraps = np.abs(x) > 1e20
            mine, deq = mine[~wraps], deq[~wraps]
        # DequantizeLinear gives +0.0 for a code 0 where the fake quantizer keeps -0.0's sign (c * s):
        # the same value; every other bit pattern must agree.
        assert_bits_equal(np.where(mine == 0, 0, mine), np.where(deq == 0, 0, deq), oracle)
    qmin, qmax = (0, 0) if fmt.is_float8 else code_range(fmt)
    expect = _mask_oracle(fmt, x, _expand(gran, scale, shape), _expand(gran, zp, shape), qmin, qmax)
    np.testing.assert_array_equal(_unpacked(gen_m, xt, a).numpy(), expect)


@pytest.mark.parametrize("fmt", FORMATS_Q, ids=lambda f: f.name)
@pytest.mark.parametrize("gid,shape,gran,axis,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_nonfinite_inputs_as_functional_reference(fmt, gid, shape, gran, axis, block):
    """NaN stays NaN and +-inf saturate, as dal.formats.fake_quantize (the functional reference)."""
    from dal.formats import fake_quantize as reference
    x, scale, zp = case(fmt, shape, gran, seed=7, nonfinite=True)
    xt, st, zt = torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zp)
    a = _args(fmt, gran, xt)
    gen_y, gen_m = FQ.generic(xt, st, zt, *a, True)
    kern = FQ.cpu_kernel(xt, st, zt, *a, True)
    if kern is not None:
        assert_bits_equal(kern[0], gen_y)
        assert torch.equal(kern[1], gen_m)
    ref = reference(xt, fmt, st, None if fmt.is_float8 else zt, gran)
    assert_bits_equal(gen_y, ref, "vs dal.formats.fake_quantize")
    assert not _unpacked(gen_m, xt, a).reshape(-1)[4:7].any()  # no gradient through NaN or a saturated inf


def test_exact_ties_round_half_even_and_signed_zero():
    """Power-of-two scale: x / s is exact, so k + 0.5 are true ties (half to even); -0.0 keeps its sign
    on both paths (c * s with c = -0.0)."""
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -128.5, -0.0, 0.0] * 4) * 0.25
    s = torch.tensor(0.25)
    expect = torch.tensor([0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 126.0, 127.0, -128.0, -0.0, 0.0] * 4) * 0.25
    a = (-128.0, 127.0, None, 0, 0)
    zp = torch.tensor(0, dtype=torch.int32)
    for y in (FQ.generic(x, s, zp, *a, False)[0], FQ.cpu_kernel(x, s, zp, *a, False)[0]):
        assert_bits_equal(y, expect)


def test_subnormal_scale():
    """A subnormal float32 scale: x / s overflows to inf for ordinary x (saturates), 0 stays 0."""
    s = torch.tensor(1e-40)
    assert s.item() != 0 and abs(s.item()) < torch.finfo(torch.float32).tiny
    x = torch.tensor([0.0, 1e-45, -1e-45, 3e-40, 1.0, -1.0, 1e-38] * 3)
    a = (-128.0, 127.0, None, 0, 0)
    zp = torch.tensor(0, dtype=torch.int32)
    gen, kern = FQ.generic(x, s, zp, *a, True), FQ.cpu_kernel(x, s, zp, *a, True)
    assert_bits_equal(gen[0], kern[0])
    assert torch.equal(gen[1], kern[1])
    _, deq = run("ort", FORMATS["int8"], x.numpy(), s.numpy(), np.zeros((), np.int32))
    assert_bits_equal(np.where(gen[0].numpy() == 0, 0, gen[0].numpy()), deq)


@pytest.mark.parametrize("fmt", ["int8", "uint8", "fp8_e4m3"])
def test_bfloat16_input_scales_and_rounds_in_float32(fmt):
    """bf16 in, bf16 out: the result is the float32 fake quantization of the same values (the ONNX
    oracle's, on x widened exactly to float32) rounded once to bfloat16."""
    fmt = FORMATS[fmt]
    x, scale, zp = case(fmt, (4, 6, 10), per_channel(1), seed=3)
    xb = torch.from_numpy(x).to(torch.bfloat16)
    y = K.fake_quantize(xb, torch.from_numpy(scale), torch.from_numpy(zp), fmt, per_channel(1))
    assert y.dtype == torch.bfloat16
    _, deq = run("ort", fmt, xb.float().numpy(), scale, zp, 1, 0)
    expect = torch.from_numpy(np.ascontiguousarray(deq)).to(torch.bfloat16)
    assert torch.equal(y, expect)


def test_channels_last_input():
    """A channels-last input takes the generic path; same values as the contiguous C++ path, and the
    output keeps the input's layout (as the fake implementation promises)."""
    x = torch.randn(2, 8, 5, 5) * 3
    scale, zp = torch.rand(8) * 0.05 + 0.01, torch.zeros(8, dtype=torch.int32)
    xc = x.contiguous(memory_format=torch.channels_last)
    y = K.fake_quantize(xc, scale, zp, "int8", per_channel(1))
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_bits_equal(y, K.fake_quantize(x, scale, zp, "int8", per_channel(1)))


def test_backward_is_the_clip_mask():
    x = (torch.randn(64, 33) * 5).requires_grad_()
    s = torch.tensor(0.02)
    y = K.fake_quantize(x, s, None, "int8")
    g = torch.randn_like(x)
    y.backward(g)
    r = np.rint(x.detach().numpy() / np.float32(0.02))
    inside = (r >= -128) & (r <= 127)
    assert_bits_equal(x.grad, g.numpy() * inside)
    assert 0 < inside.mean() < 1


def test_mask_unpacking_odd_row_lengths():
    """Rows of 1..17 elements (the kernel pads each row's bits to whole bytes)."""
    for n in range(1, 18):
        x = torch.linspace(-4, 4, 3 * n).reshape(3, n)
        s, zp = torch.full((3,), 0.02), torch.zeros(3, dtype=torch.int32)
        a = (-128.0, 127.0, 0, 0, 0)
        assert torch.equal(FQ.cpu_kernel(x, s, zp, *a, True)[1], FQ.generic(x, s, zp, *a, True)[1])


@pytest.mark.parametrize("gran", [PER_TENSOR, per_channel(1)], ids=str)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_opcheck(fmt, gran):
    fmt = FORMATS[fmt]
    x, scale, zp = case(fmt, (4, 6, 10), gran, seed=5)
    xt = torch.from_numpy(x)
    a = _args(fmt, gran, xt)
    for need in (True, False):
        args = (xt.clone().requires_grad_(need), torch.from_numpy(scale), torch.from_numpy(zp), *a, need)
        torch.library.opcheck(torch.ops.dal.fake_quantize.default, args)
    xb = xt.to(torch.bfloat16)
    torch.library.opcheck(torch.ops.dal.fake_quantize.default, (xb, torch.from_numpy(scale), torch.from_numpy(zp),
                                                                 *a, False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", FORMATS_Q, ids=lambda f: f.name)
@pytest.mark.parametrize("gid,shape,gran,axis,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
def test_cuda_generic_equals_cpu_kernel(fmt, gid, shape, gran, axis, block):
    """The device-generic implementation on CUDA gives the CPU kernel's bits (IEEE division, half-even
    rounding, saturating FP8 casts), mask included; NaN / inf as on the CPU."""
    x, scale, zp = case(fmt, shape, gran, seed=11, nonfinite=True)
    xt, st, zt = torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zp)
    a = _args(fmt, gran, xt)
    cpu_y, cpu_m = FQ._cpu(xt, st, zt, *a, True)
    gpu_y, gpu_m = torch.ops.dal.fake_quantize(xt.cuda(), st.cuda(), zt.cuda(), *a, True)
    assert_bits_equal(gpu_y.cpu(), cpu_y)
    assert torch.equal(gpu_m.cpu(), cpu_m)


@pytest.mark.parametrize("shape,gran", [((3, 5, 7), PER_TENSOR), ((3, 5, 7), per_channel(0)),
                                        ((3, 5, 7), per_channel(1)), ((4, 6, 10), per_group(2, 5)),
                                        ((4, 6, 10), per_group(1, 3))], ids=str)
def test_mask_grad_kernel_equals_generic_and_numpy(shape, gran):
    """dal::mask_grad's C++ path (dal_fq_backward over the packed mask) and its generic path give
    g * inside bit for bit (numpy: -0.0 where a negative g meets a clipped element), odd row
    lengths included; the mask packed by the C++ forward and by pack_mask are the same bytes."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 6
    s = torch.full(gran.scale_shape(shape), 0.03)
    zp = torch.zeros(s.shape, dtype=torch.int32)
    a = (-128.0, 127.0, gran.normalized_axis(len(shape)), gran.block_size, 0)
    _, packed = FQ.generic(x, s, zp, *a, True)
    kern = FQ.cpu_kernel(x, s, zp, *a, True)
    if kern is not None:
        assert torch.equal(kern[1], packed)
    rows, row_len = FQ.mask_layout(x.shape, a[2], a[3])
    g = torch.randn(shape)
    inside = np.abs(np.rint(x.numpy() / np.float32(0.03))) <= 127
    inside &= np.rint(x.numpy() / np.float32(0.03)) >= -128
    want = g.numpy() * inside
    assert (~inside).any() and inside.any() and (want[~inside] == 0).all()
    assert_bits_equal(FQ.mask_grad_op(g, packed, rows, row_len), want, "C++ path")
    assert_bits_equal(FQ.mask_grad_generic(g, packed, rows, row_len), want, "generic path")
    gc = g.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # a strided gradient takes the generic path
    assert_bits_equal(FQ.mask_grad_op(gc, packed, rows, row_len), want, "strided")
