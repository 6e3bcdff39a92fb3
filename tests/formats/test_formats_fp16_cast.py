"""The FP16 / BF16 cast round trip in one C++ pass (dal.formats.fp_cast) against torch's own
conversion ``x.to(float16 / bfloat16).to(float32)``, bit for bit (NaN: NaN-ness only), with numpy's
float16 as a second oracle: random bit patterns over the whole float32 range, every float16 /
bfloat16 value and every rounding boundary (halfway cases, ties to even) +-1 ulp, subnormals of
both formats and of float32, +-0, +-inf, NaNs, the overflow edge at 65504 / 65520, one and two
threads, lengths that leave a scalar tail. The gradient is the identity; the torch path still
runs where the kernel must not (tracing: the exported ONNX of an FP16 island keeps its Casts)."""
import copy
import os

import numpy as np
import pytest
import torch
from torch import nn

import dal
from dal.formats import FP16, BF16, fake_quantize, native
from dal.formats import fp_cast

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

DTYPES = [torch.float16, torch.bfloat16]
LENGTHS = [1, 7, 9, 17, 16385, 100_003]  # odd: the scalar tail after the 8-wide vectors; > 4 chunks


def _bits(t):
    return t.contiguous().view(torch.int32)


def _assert_same(got, want):
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (_bits(got) != _bits(want)) & ~nan
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} values differ, e.g. x[{i}]: {got[i].item()!r} vs {want[i].item()!r}")


def _kernel(x, dtype):
    out = fp_cast.kernel_round_trip(x, dtype)
    assert out is not None, native.status()
    return out


def _from_bits(bits):
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())


def _narrow_values(dtype):
    """Every finite value of the 16-bit format and every midpoint between neighbours (both exact
    in float32), each +-1 float32 ulp: all of the format's rounding boundaries."""
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).float()
    v = torch.unique(codes[torch.isfinite(codes)]).double()  # sorted, -0 and +0 merged
    mid = ((v[1:] + v[:-1]) / 2).float()  # one more bit than the format: exact in float32
    assert torch.equal(mid.double(), (v[1:] + v[:-1]) / 2)
    pts = torch.cat([v.float(), mid, -v.float()])
    return torch.cat([pts, torch.nextafter(pts, torch.tensor(np.inf)), torch.nextafter(pts, torch.tensor(-np.inf))])


def _specials():
    inf, nan = float("inf"), float("nan")
    vals = torch.tensor([0.0, -0.0, inf, -inf, nan, -nan, 65504.0, 65519.996, 65520.0, 65520.004, 65536.0, 1e5,
                         -65520.0, -65519.996, 3.4028235e38, -3.4028235e38, 2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25,
                         2.0 ** -26, 2.0 ** -14, 2.0 ** -133, 2.0 ** -149, -2.0 ** -149, 1.17549435e-38])
    nans = _from_bits([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0x7F802000, 0x7FBFFFFF])
    f32_subnormals = _from_bits(np.arange(1, 1 << 23, 4099, dtype=np.uint32))
    return torch.cat([vals, nans, f32_subnormals, -f32_subnormals])


def _random_bits(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["random", "boundaries", "specials"])
def test_kernel_matches_torch_bit_for_bit(dtype, source):
    x = {"random": lambda: _random_bits(300_001), "boundaries": lambda: _narrow_values(dtype),
         "specials": _specials}[source]()
    _assert_same(_kernel(x, dtype), x.to(dtype).to(torch.float32))


def test_float16_matches_numpy_too():
    """A second oracle: numpy's float32 -> float16 cast (round to nearest even, overflow to inf)."""
    x = torch.cat([_random_bits(100_001, seed=3), _narrow_values(torch.float16), _specials()])
    with np.errstate(over="ignore", invalid="ignore"):
        want = torch.from_numpy(x.numpy().astype(np.float16).astype(np.float32))
    _assert_same(_kernel(x, torch.float16), want)


def test_overflow_edge_and_ties():
    x = torch.tensor([65504.0, 65519.996, 65520.0, -65520.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -25])
    want = [65504.0, 65504.0, float("inf"), -float("inf"), 1.0, 1.0 + 2 * 2.0 ** -10, 0.0]
    assert _kernel(x, torch.float16).tolist() == want  # the ties go to the even neighbour


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_and_tails(threads, n, dtype):
    x = torch.cat([_random_bits(n, seed=n), _specials()[:300]])
    tail = torch.cat([torch.tensor([float("nan"), 65520.0, -float("inf"), -0.0, 2.0 ** -25, 1.0 + 2.0 ** -11]),
                      _from_bits([0x7F800001])])  # the last (n % 8) values go through the scalar tail
    x = torch.cat([x[:n - min(n, 7)], tail[-min(n, 7):]])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _kernel(x, dtype)
    finally:
        torch.set_num_threads(before)
    _assert_same(got, x.to(dtype).to(torch.float32))


@pytest.mark.parametrize("fmt", [FP16, BF16])
def test_gradient_is_the_identity(fmt):
    """fake_quantize's gradient is the incoming gradient, bit for bit (NaN, inf, -0 included), and
    the forward is the kernel's through the public function, with or without a gradient."""
    x = _random_bits(1003, seed=7).nan_to_num(0.0).requires_grad_()
    g = _random_bits(1003, seed=8)
    y = fake_quantize(x, fmt)
    y.backward(g)
    assert torch.equal(_bits(x.grad), _bits(g))
    _assert_same(y.detach(), x.detach().to(fmt.torch_dtype()).float())
    with torch.no_grad():
        _assert_same(fake_quantize(x, fmt), y.detach())


def test_torch_path_where_the_kernel_does_not_apply():
    x = torch.randn(64, 33)
    for y in (x.t(), x.double(), x.half(), torch.empty(0)):
        assert fp_cast.kernel_round_trip(y, torch.float16) is None
    assert fp_cast.kernel_round_trip(x, torch.float8_e4m3fn) is None
    _assert_same(fake_quantize(x.t(), FP16), x.t().half().float())  # non-contiguous: torch's casts
    previous = fp_cast.use_kernel(False)
    try:
        assert fp_cast.kernel_round_trip(x, torch.float16) is None
    finally:
        fp_cast.use_kernel(previous)
    seen = []

    def traced(t):
        seen.append(fp_cast.kernel_round_trip(t, torch.float16))
        return fake_quantize(t, FP16)

    torch.jit.trace(traced, (x,), check_trace=False)
    assert seen == [None]  # under tracing the casts are recorded (the export below), never the kernel


class _Island(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.Hardswish()
        self.conv2 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.conv2(self.act(self.conv(x)))


def test_island_trains_the_same_and_exports_its_casts():
    """A Hardswish between convs on the a2000 is an FP16 island: its QAT step with the kernel and
    with torch's casts give the same output and gradients, and the exported ONNX still holds
    Cast(FLOAT16) -> Cast(FLOAT) on both sides of the Hardswish."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    qat = dal.prepare_qat(_Island(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(qat, [torch.randn(2, 3, 8, 8) for _ in range(2)], progress=False)
    assert "state=quantize" in repr(qat.act.input_quant)  # the island rounds: the kernel is in use
    runs = []
    for on in (True, False):
        previous = fp_cast.use_kernel(on)
        try:
            m = copy.deepcopy(qat).train()  # the same observer state for both runs
            m.zero_grad()
            out = m(x)
            out.square().sum().backward()
            runs.append([out.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None])
        finally:
            fp_cast.use_kernel(previous)
    for a, b in zip(*runs):
        _assert_same(a.reshape(-1), b.reshape(-1))
    proto = dal.export_onnx(qat.eval(), (x,))
    made_by = {o: n for n in proto.graph.node for o in n.output}
    to = {n.name: next(a.i for a in n.attribute if a.name == "to") for n in proto.graph.node if n.op_type == "Cast"}
    (hs,) = [n for n in proto.graph.node if n.op_type == "HardSigmoid"]  # HardSwish = x * HardSigmoid(x)
    c32 = made_by[hs.input[0]]
    assert c32.op_type == "Cast" and to[c32.name] == 1 and to[made_by[c32.input[0]].name] == 10
    (mul,) = [n for n in proto.graph.node if hs.output[0] in n.input]
    assert mul.op_type == "Mul" and c32.output[0] in mul.input
    readers = [n for n in proto.graph.node if mul.output[0] in n.input]
    assert [to.get(n.name) for n in readers] == [10]
    assert [to.get(n.name) for n in proto.graph.node if readers[0].output[0] in n.input] == [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_build_matches_torch(dtype, tmp_path):
    """The kernel built without AVX2 / F16C (a CPU without them: every value takes the scalar
    code, the vector tail's fallback) gives the same bits on every boundary and special value."""
    import ctypes

    flags = ["-O2", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]
    source = os.path.join(os.path.dirname(native.__file__), "csrc", "fake_quant.cpp")
    lib = ctypes.CDLL(native.compile_library(source, cache_dir=str(tmp_path), flags=flags))
    lib.dal_fp_cast_round_trip.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    x = torch.cat([_narrow_values(dtype), _specials(), _random_bits(50_001, seed=11)])
    out = torch.empty_like(x)
    lib.dal_fp_cast_round_trip(x.data_ptr(), out.data_ptr(), x.numel(), fp_cast.DTYPE_CODES[dtype], 1)
    _assert_same(out, x.to(dtype).to(torch.float32))
