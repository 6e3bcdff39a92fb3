"""INT32 (the bias format) saturates like ONNX QuantizeLinear: ``clip(round_half_even(x / s) + zp)``.

onnxruntime has no int32 QuantizeLinear and onnx.reference wraps beyond 2**31 (it casts to int32 before clipping), so the
oracle is the spec's formula in float64 numpy, written here.
"""
import numpy as np
import torch

from dal.formats import INT32, dequantize, quantize


def _spec(x: np.ndarray, s: np.float32) -> np.ndarray:
    v = np.rint(x.astype(np.float32) / s).astype(np.float64)  # the division is float32, as in ONNX
    return np.clip(v, -2.0 ** 31, 2.0 ** 31 - 1).astype(np.int64)


def test_int32_saturates_with_the_right_sign():
    x = np.array([3e9, -3e9, 2.2e9, -2.2e9, 1e3, -0.5, 2147483500.0, 1.5, 2.5], np.float32)
    s = np.float32(1.0)
    got = quantize(torch.from_numpy(x), INT32, float(s)).numpy().astype(np.int64)
    np.testing.assert_array_equal(got, _spec(x, s))
    assert got[0] == 2 ** 31 - 1 and got[1] == -2 ** 31  # a float32 clamp would wrap the first to -2**31


def test_int32_round_trip_on_random_biases():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-3, 10, 4096)).astype(np.float32)
    s = np.float32(3.7e-4)
    got = quantize(torch.from_numpy(x), INT32, float(s)).numpy().astype(np.int64)
    np.testing.assert_array_equal(got, _spec(x, s))
    back = dequantize(torch.from_numpy(got.astype(np.int32)), INT32, float(s)).numpy()
    np.testing.assert_array_equal(back, (got.astype(np.float32) * s).astype(np.float32))
