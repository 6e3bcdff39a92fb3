"""The fused C++ kernel (dal/formats/fused.py) against the eager autograd function: same bits
forward and backward; its FP8 rounding against ml_dtypes; fallback and laziness."""
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

import dal.formats as F
from dal.formats import fused, native
from dal.formats.autograd import FakeQuantizeFunction
from formats_common import FP8_FORMATS, INT_FORMATS

# The compiler dal.formats.native builds with ($CXX, else c++, else g++). Without one the
# kernel cannot exist and these tests skip; with one, a kernel that fails to build or load is
# a failure (a compile error in csrc/fake_quant.cpp must not turn into skips).
_CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@pytest.fixture(scope="module")
def kernel():
    if _CXX is None:
        pytest.skip("no C++ compiler ($CXX, c++, g++): the fused kernel cannot be built here")
    lib = native.library()
    assert lib is not None, f"a C++ compiler exists ({_CXX}) but the fused kernel did not load: {native.status()}"
    return lib


def _special(n, gen):
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 4, (n,), generator=gen).float()
    x[: 12] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                            1e-45, -1e-40, 3.4e38, -3.4e38, 2.5, -2.5])
    return x[torch.randperm(n, generator=gen)]


CASES = [  # shape, granularity
    ((37,), F.PER_TENSOR),
    ((3, 7, 5, 13), F.PER_TENSOR),
    ((3, 7, 5, 13), F.per_channel(1)),
    ((3, 7, 5, 13), F.per_channel(-1)),
    ((6, 40), F.per_channel(0)),
    ((4, 30), F.per_group(1, 10)),
    ((2, 3, 24), F.per_group(-1, 8)),
    ((2, 40000), F.per_channel(0)),  # rows longer than a work chunk (16384)
    ((70001,), F.PER_TENSOR),        # many chunks and a ragged tail
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,gran", CASES, ids=[f"{s}-{g}" for s, g in CASES])
@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS, ids=lambda f: f.name)
def test_fused_is_bit_identical_to_eager(kernel, fmt, shape, gran, threads):
    # crc32, not hash(): str hashes change per process (PYTHONHASHSEED)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{fmt.name}{shape}".encode()))
    n = int(np.prod(shape))
    x = _special(n, gen).reshape(shape).requires_grad_()
    sshape = gran.scale_shape(shape)
    scale = torch.rand(sshape, generator=gen) * 0.5 + 1e-3
    zp = torch.zeros(sshape) if fmt.is_float8 else \
        torch.randint(int(fmt.qmin), int(fmt.qmax) + 1, sshape, generator=gen).float()
    qmin, qmax = F.code_range(fmt)
    assert fused.eligible(x, scale, zp, fmt, gran)
    dy = _special(n, gen).reshape(shape)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = FakeQuantizeFunction.apply(x, scale, zp, fmt, gran, qmin, qmax, 1.0)
        b = fused.FusedFakeQuantizeFunction.apply(x, scale, zp, fmt, gran, qmin, qmax)
        (ga,), (gb,) = torch.autograd.grad(a, x, dy), torch.autograd.grad(b, x, dy)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))   # NaN payloads and -0.0 included
    assert torch.equal(ga.view(torch.int32), gb.view(torch.int32))
    with torch.no_grad():  # the no-mask forward
        c = fused.FusedFakeQuantizeFunction.apply(x, scale, zp, fmt, gran, qmin, qmax)
    assert torch.equal(a.view(torch.int32), c.view(torch.int32))


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_fused_fp8_rounding_matches_ml_dtypes(kernel, fmt):
    """Every sign/exponent/high-mantissa pattern (all 2^16 upper halves, random lower halves),
    every FP8 value, every tie between neighbours and the floats next to them, 1M random
    patterns: the kernel's RNE + saturate equals clip-then-ml_dtypes-cast (ONNX saturate=1)."""
    rng = np.random.default_rng(0)
    npdt = fmt.numpy_dtype()
    grid = np.arange(256, dtype=np.uint8).view(npdt).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = (grid[1:] + grid[:-1]) / 2
    pieces = [
        (np.arange(2 ** 16, dtype=np.uint32) << 16 | rng.integers(0, 2 ** 16, 2 ** 16, dtype=np.uint32)).view(np.float32),
        (np.arange(2 ** 16, dtype=np.uint32) << 16).view(np.float32),
        grid.astype(np.float32), mids.astype(np.float32),
        np.nextafter(mids.astype(np.float32), np.float32(np.inf)), np.nextafter(mids.astype(np.float32), np.float32(-np.inf)),
        rng.integers(0, 2 ** 32, 1_000_000, dtype=np.uint32).view(np.float32),
    ]
    x = np.concatenate(pieces).astype(np.float32)
    with np.errstate(invalid="ignore"):
        expected = np.clip(x, -fmt.max_value, fmt.max_value).astype(npdt).astype(np.float32)
    got = F.fake_quantize(torch.from_numpy(x), fmt, 1.0).numpy()  # scale 1: out = rne_fp8(clip(x))
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bad = np.flatnonzero(got[~nan].view(np.int32) != expected[~nan].view(np.int32))
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[~nan][bad[:5]]} got {got[~nan][bad[:5]]} want {expected[~nan][bad[:5]]}"


def test_fake_quantize_dispatch(kernel):
    x = torch.randn(4, 8, requires_grad=True)
    s = torch.tensor(0.1)
    assert type(F.fake_quantize(x, "int8", s).grad_fn).__name__.startswith("FusedFakeQuantize")
    # learnable scale (LSQ), float64, non-contiguous, per-group on a middle axis: the eager path
    learn = s.clone().requires_grad_()
    for y in (F.fake_quantize(x, "int8", learn, check=False), F.fake_quantize(x.double(), "int8", s),
              F.fake_quantize(x.t(), "int8", s), F.fake_quantize(x, "int8", torch.ones(2, 8), granularity=F.per_group(0, 2))):
        assert type(y.grad_fn).__name__.startswith("FakeQuantizeFunction")


def test_fallback_without_kernel_gives_same_bits(kernel, monkeypatch):
    x = torch.randn(3, 5, 7) * 30
    want = F.fake_quantize(x, "int4", torch.ones(5) * 0.7, granularity=F.per_channel(1))
    monkeypatch.setattr(native, "library", lambda: None)
    assert not fused.eligible(x, torch.ones(5), torch.zeros(5), F.INT4, F.per_channel(1))
    got = F.fake_quantize(x, "int4", torch.ones(5) * 0.7, granularity=F.per_channel(1))
    assert torch.equal(want, got)


def test_import_builds_nothing():
    code = ("import dal, dal.formats, dal.quantizer, dal.observers; from dal.formats import native; "
            "assert native.library.cache_info().currsize == 0, 'built at import'; print(native.status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "not built yet" in out.stdout
