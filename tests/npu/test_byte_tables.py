"""The 8-bit code lookups in C++ (csrc/lut16.cpp ``lut8``, byte_tables.py) and the C++ quantizer's
byte store (csrc/quantize.cpp ``quant_avx2_bytes``), each forced against the path it replaces.

Oracles: numpy's ``np.take`` of the same table (the lookup copies entries: every bit, NaN
payloads and signed zeros included) and numpy's float32 QuantizeLinear formula
``clip(rint(x / s) + zp, lo, hi)`` (ONNX's, quant.py), on ties, saturation, +-inf, signed zeros,
subnormals and every length 1..40 (the 8-wide loop's tail)."""
from __future__ import annotations

import numpy as np
import pytest

from dal.npu import byte_tables
from dal.npu.byte_tables import ByteTable


def _edge_table():
    t = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    t[:8] = [np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-45, 3.4e38, np.nan]
    t.view(np.uint32)[8] = 0x7FC01234  # a NaN with a payload
    t.view(np.uint32)[9] = 0xFF800001  # a signalling-pattern NaN
    return t


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("shape", [(7,), (4095,), (4096,), (1, 4, 128, 129)])
def test_lut8_equals_take(npu_lib, dtype, shape):
    t = _edge_table()
    rng = np.random.default_rng(sum(shape))
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes.reshape(-1)[:256 if codes.size >= 256 else codes.size] = np.arange(min(256, codes.size))
    codes = codes.view(dtype)
    want = np.take(t, codes.view(np.uint8))
    bt = ByteTable(t)
    got = bt.lookup(codes.view(np.uint8))
    assert got.dtype == np.float32 and got.shape == codes.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (bt._kernel is not None) == (codes.size >= byte_tables.LARGE)  # the C++ path was taken when large


def test_lut8_strided_codes_and_raw_kernel_checks(npu_lib):
    import torch
    t = _edge_table()
    codes = np.random.default_rng(2).integers(0, 256, (1, 1, 64, 96)).astype(np.uint8)
    view = np.broadcast_to(codes, (1, 4, 64, 96))  # an Expand view, as code_moves hands it
    got = ByteTable(t).lookup(view)
    assert np.array_equal(got.view(np.uint32), np.take(t, view).view(np.uint32))
    lut8 = npu_lib.lut8
    with pytest.raises(RuntimeError, match="table must be contiguous float32 \\[256\\]"):
        lut8(torch.zeros(8, dtype=torch.uint8), torch.zeros(255))
    with pytest.raises(RuntimeError, match="table must be"):
        lut8(torch.zeros(8, dtype=torch.uint8), torch.zeros(256, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="C must be contiguous uint8"):
        lut8(torch.zeros(8, dtype=torch.int16), torch.zeros(256))
    with pytest.raises(RuntimeError, match="C must be contiguous"):
        lut8(torch.zeros(8, 8, dtype=torch.uint8).t(), torch.zeros(256))


def test_table_not_float32_stays_numpy():
    t = np.arange(256, dtype=np.uint8).view(np.int8)  # a code table (present_* outputs)
    bt = ByteTable(t)
    codes = np.random.default_rng(3).integers(0, 256, 10000).astype(np.uint8)
    got = bt.lookup(codes)
    assert got.dtype == np.int8 and np.array_equal(got, np.take(t, codes)) and bt._kernel is None


def _numpy_codes(x, s, zp, dt):
    info = np.iinfo(dt)
    with np.errstate(over="ignore"):  # +-3e38 / s: +-inf, saturated below
        r = np.rint(x / np.float32(s)).astype(np.float64)
    return np.clip(r + zp, info.min, info.max).astype(dt)


def _edges(s, n, seed):
    rng = np.random.default_rng(seed)
    k = rng.integers(-300, 300, n).astype(np.float32)
    x = (k + np.float32(0.5)) * np.float32(s)  # near ties, both sides of them
    special = np.array([np.inf, -np.inf, 3e38, -3e38, 1e-40, -1e-40, -0.0, 0.0, 127.5 * s, -128.5 * s,
                        255.5 * s, 0.5 * s, -0.5 * s, 1.5 * s, 2.5 * s, 1e9, -1e9], np.float32)
    x[: min(n, special.size)] = special[: min(n, special.size)]
    return rng.permutation(x)


@pytest.mark.parametrize("dt,code,zp", [(np.uint8, 1, 0), (np.uint8, 1, 131), (np.uint8, 1, 255),
                                        (np.int8, 2, 0), (np.int8, 2, -128), (np.int8, 2, 127), (np.int8, 2, -3)])
def test_quantize_byte_store_equals_scalar_and_numpy(npu_lib, dt, code, zp):
    """The flat AVX2 form (bytes packed in registers) against the portable form (isa 0: the
    scalar loop and its int32 buffer) and numpy, every length 1..40 and 4096 +- 1, 1 and 2 threads."""
    import torch
    from dal.npu import info
    from dal.npu.dispatch import NAMES
    s = float(np.float32(0.0371))
    avx2 = [NAMES.index(k) for k in info()["supported"] if NAMES.index(k) >= 1]
    if not avx2:
        pytest.skip("no AVX2 kernel variant on this CPU: the byte store never runs")
    for n in list(range(1, 41)) + [4095, 4097, 8200]:
        x = _edges(s, n, n)
        want = _numpy_codes(x, s, zp, dt)
        tx = torch.from_numpy(x)
        old = npu_lib.quantize_codes(tx, s, zp, code, False, 1, 0).numpy().view(dt)
        assert np.array_equal(old, want), n
        for isa in avx2:
            for threads in (1, 2):
                got = npu_lib.quantize_codes(tx, s, zp, code, False, threads, isa).numpy().view(dt)
                assert np.array_equal(got, want), (n, isa, threads)
