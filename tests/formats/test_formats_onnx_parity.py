"""dal.quantize / dequantize / fake_quantize against ONNX QuantizeLinear / DequantizeLinear as
computed by onnx.reference and onnxruntime (ORT_DISABLE_ALL), and FP8 against ml_dtypes."""
import ml_dtypes
import numpy as np
import pytest
import torch

import dal.formats as F
from dal.formats.autograd import FakeQuantizeFunction

from formats_common import FP8_FORMATS, GRANULARITIES, INT_FORMATS, assert_same_floats
from formats_oracle import run


def _data(rng, shape, fmt, gran):
    """Normal data with a mix of scales, exact ties of x / scale, saturating values, subnormals."""
    scale_shape = gran.scale_shape(shape)
    scale = np.asarray(rng.uniform(0.5, 2.0, scale_shape) * 10.0 ** rng.integers(-3, 2, scale_shape), np.float32)
    if fmt.is_integer:
        zp = rng.integers(int(fmt.qmin), int(fmt.qmax) + 1, scale_shape)
        span = (fmt.qmax - fmt.qmin) * 0.8
    else:
        zp = np.zeros(scale_shape, np.int64)
        span = fmt.max_value * 1.5
    s = torch.from_numpy(scale)
    s_full = gran.expand(s, shape).expand(shape).numpy()
    v = rng.normal(0, span / 3, shape).astype(np.float32)
    ties = (np.floor(v) + np.float32(0.5)).astype(np.float32)
    v = np.where(rng.random(shape) < 0.3, ties, v)
    x = (v * s_full).astype(np.float32)
    flat = x.reshape(-1)
    flat[:4] = [1e-40, -1e-42, 0.0, -0.0]  # subnormals and both zeros
    return x, scale, zp


def _dal_codes(fmt, q: torch.Tensor) -> np.ndarray:
    return q.float().numpy() if fmt.is_float8 else q.to(torch.int32).numpy()


@pytest.mark.parametrize("oracle", ["ref", "ort"])
@pytest.mark.parametrize("gid,shape,gran,axis,block", GRANULARITIES, ids=[g[0] for g in GRANULARITIES])
@pytest.mark.parametrize("fmt", INT_FORMATS + FP8_FORMATS, ids=lambda f: f.name)
def test_quantize_dequantize_bit_exact(fmt, gid, shape, gran, axis, block, oracle, rng):
    x, scale, zp = _data(rng, shape, fmt, gran)
    codes, deq = run(oracle, fmt, x, scale, zp, axis, block)
    xt, st, zt = torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zp)
    q = F.quantize(xt, fmt, st, zt, gran)
    assert q.dtype == fmt.torch_dtype()
    if fmt.is_float8:
        assert_same_floats(_dal_codes(fmt, q), codes, "codes")
    else:
        np.testing.assert_array_equal(_dal_codes(fmt, q), codes)
    assert_same_floats(F.dequantize(q, fmt, st, zt, gran), deq, "dequantize")
    # fake_quantize = DQ(Q(x)) on both of dal's paths (fused kernel where it applies, and eager)
    assert_same_floats(F.fake_quantize(xt, fmt, st, zt, gran), deq, "fake_quantize")
    qmin, qmax = F.code_range(fmt)
    eager = FakeQuantizeFunction.apply(xt, st, zt.float(), fmt, gran, qmin, qmax, 1.0)
    assert_same_floats(eager, deq, "eager fake_quantize")


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_fp8_matches_ml_dtypes(fmt, rng):
    """ONNX saturate=1 == clip to the finite max, then ml_dtypes' RNE cast (measured: bit-exact with the ONNX spec on ~89k values per format)."""
    npdt = fmt.numpy_dtype()
    finfo = ml_dtypes.finfo(npdt)
    grid = np.array(sorted(set(np.arange(256, dtype=np.uint8).view(npdt).astype(np.float32).tolist())
                           - {float("nan")}), np.float32)
    grid = grid[np.isfinite(grid)]
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)  # exact ties
    near = np.concatenate([np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
    extra = np.array([float(finfo.max) * k for k in (1.01, 1.06, 1.5, 1e3)] + [1e38, 3.4e38, 1e-45, 1e-40], np.float32)
    x = np.concatenate([grid, mids, near, extra, -extra, rng.standard_normal(20000).astype(np.float32)
                        * np.float32(fmt.max_value) / 4]).astype(np.float32)
    for scale in (1.0, 0.37, 2.0 ** -7):
        with np.errstate(over="ignore"):
            v = x / np.float32(scale)
        expected = np.clip(v, -fmt.max_value, fmt.max_value).astype(npdt).astype(np.float32)
        q = F.quantize(torch.from_numpy(x), fmt, scale)
        assert_same_floats(q.float(), expected, f"quantize scale={scale}")
        assert_same_floats(F.fake_quantize(torch.from_numpy(x), fmt, scale),
                           (expected * np.float32(scale)).astype(np.float32), f"fake_quantize scale={scale}")
        # onnxruntime is independent of ml_dtypes (onnx.reference is not)
        codes, _ = run("ort", fmt, x, np.array(scale, np.float32), np.zeros((), np.int64))
        assert_same_floats(codes, expected, f"onnxruntime scale={scale}")


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
def test_nonfinite_integer(fmt):
    """+-inf and values far beyond the range saturate (the spec; onnxruntime agrees); NaN has no
    code in the spec: dal quantizes it to the zero point (dequantizes to 0.0) and fake_quantize
    keeps it NaN so it stays visible in the float model."""
    zp = int(fmt.qmin + fmt.qmax + 1) // 2 if not fmt.signed else 1
    x = np.array([np.inf, -np.inf, 3e9, -3e9, 3.4e38, -3.4e38, np.nan], np.float32)
    q = F.quantize(torch.from_numpy(x), fmt, 0.5, zp).to(torch.int32).numpy()
    assert q.tolist() == [fmt.qmax, fmt.qmin] * 3 + [zp]
    codes, _ = run("ort", fmt, x[:6], np.array(0.5, np.float32), np.array(zp))
    np.testing.assert_array_equal(q[:6], codes)
    fq = F.fake_quantize(torch.from_numpy(x), fmt, 0.5, zp)
    assert torch.isnan(fq[6]) and fq[0] == (fmt.qmax - zp) * 0.5 and fq[1] == (fmt.qmin - zp) * 0.5


@pytest.mark.parametrize("fmt", FP8_FORMATS, ids=lambda f: f.name)
def test_nonfinite_fp8(fmt):
    """ONNX saturate=1: +-inf -> +-max, NaN -> NaN (onnxruntime agrees)."""
    x = np.array([np.inf, -np.inf, np.nan, 1e30, -1e30], np.float32)
    q = F.quantize(torch.from_numpy(x), fmt, 1.0).float().numpy()
    m = fmt.max_value
    assert_same_floats(q, np.array([m, -m, np.nan, m, -m], np.float32))
    codes, _ = run("ort", fmt, x, np.array(1.0, np.float32), np.zeros((), np.int64))
    assert_same_floats(q, codes)
