"""Shared by tests/kernels: inputs with edge values for every format and granularity."""
import numpy as np
import torch

from dal.formats import FORMATS, per_channel, per_group, PER_TENSOR

FORMATS_Q = [FORMATS[n] for n in ("int8", "uint8", "int4", "uint4", "int16", "fp8_e4m3", "fp8_e5m2")]

# (id, shape, granularity, onnx axis, onnx block_size)
GRANULARITIES = [
    ("per_tensor", (4, 6, 10), PER_TENSOR, None, 0),
    ("per_channel0", (4, 6, 10), per_channel(0), 0, 0),
    ("per_channel1", (4, 6, 10), per_channel(1), 1, 0),
    ("per_group1", (4, 6, 10), per_group(1, 3), 1, 3),      # blocks on a middle axis: no C++ layout
    ("per_group_last", (4, 6, 10), per_group(2, 5), 2, 5),  # blocks on the last axis: the C++ kernel
]


def case(fmt, shape, gran, seed=0, nonfinite=False):
    """(x, scale, zero_point) float32 / float32 / int32 numpy arrays for ``fmt`` at ``gran``: random
    values over 1.3x the range, near-ties (k + 0.5) * s, -0.0, huge values; NaN / +-inf when asked."""
    rng = np.random.default_rng(seed)
    sshape = gran.scale_shape(shape)
    if fmt.is_float8:
        scale = rng.uniform(1e-3, 1.0, sshape).astype(np.float32)
        zp = np.zeros(sshape, np.int32)
        top = fmt.max_value
    else:
        scale = rng.uniform(0.01, 0.1, sshape).astype(np.float32)
        zp = rng.integers(int(fmt.qmin), int(fmt.qmax) + 1, sshape).astype(np.int32) if not fmt.signed \
            else np.zeros(sshape, np.int32)
        top = fmt.qmax - fmt.qmin
    s = np.asarray(torch.as_tensor(scale).reshape(sshape) if gran.axis is None
                   else gran.expand(torch.as_tensor(scale), shape).expand(shape).contiguous())
    t = rng.normal(0, top / 2.5, shape)
    flat = t.reshape(-1)
    k = rng.integers(-int(top), int(top), flat.size)
    ties = rng.random(flat.size) < 0.3
    flat[ties] = k[ties] + 0.5
    x = (t * s).astype(np.float32)
    xf = x.reshape(-1)
    xf[1], xf[2], xf[3] = -0.0, 1e30, -1e30
    if nonfinite:
        xf[4], xf[5], xf[6] = np.nan, np.inf, -np.inf
    return x, scale, zp


def bits(a) -> np.ndarray:
    """int32 bit patterns of float32 values (-0.0 and +0.0 differ)."""
    a = a.detach().cpu().float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, np.float32)
    return np.ascontiguousarray(a, np.float32).view(np.int32)


def assert_bits_equal(a, b, msg=""):
    """Identical float32 bits, except that every NaN equals every NaN (payloads may differ)."""
    a = a.detach().cpu().float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, np.float32)
    b = b.detach().cpu().float().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, np.float32)
    assert a.shape == b.shape, f"{msg}: shapes {a.shape} vs {b.shape}"
    na, nb = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(na, nb, err_msg=f"NaN positions differ {msg}")
    ba, bb = bits(np.where(na, 0, a)), bits(np.where(nb, 0, b))
    bad = np.flatnonzero(ba != bb)
    assert bad.size == 0, f"{bad.size} of {a.size} differ {msg}: at {bad[:5]}: {a.flat[bad[:5]]} vs {b.flat[bad[:5]]}"
