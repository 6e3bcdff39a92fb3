"""Shared by the tests of dal.formats: format lists, granularities, exact float comparison."""
import numpy as np
import torch

from dal.formats import FORMATS, per_channel, per_group, PER_TENSOR

INT_FORMATS = [FORMATS[n] for n in ("int8", "uint8", "int4", "uint4", "int16")]
FP8_FORMATS = [FORMATS[n] for n in ("fp8_e4m3", "fp8_e5m2")]

# (id, shape, granularity, onnx axis, onnx block_size)
GRANULARITIES = [
    ("per_tensor", (4, 6, 10), PER_TENSOR, None, 0),
    ("per_channel0", (4, 6, 10), per_channel(0), 0, 0),
    ("per_channel1", (4, 6, 10), per_channel(1), 1, 0),
    ("per_group1", (4, 6, 10), per_group(1, 3), 1, 3),      # blocks on a middle axis (eager path)
    ("per_group_last", (4, 6, 10), per_group(2, 5), 2, 5),  # blocks on the last axis (fused path)
]


def bits(t: torch.Tensor) -> np.ndarray:
    """float32 bit patterns, with -0.0 folded into +0.0 (both mean zero)."""
    a = np.ascontiguousarray(t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t, np.float32) + np.float32(0)
    return a.view(np.int32)


def assert_same_floats(a, b, msg=""):
    """Equal as float32 values bit for bit (NaN at the same places, any payload; 0 == -0)."""
    a = np.asarray(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a, np.float32)
    b = np.asarray(b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else b, np.float32)
    assert a.shape == b.shape, msg
    na, nb = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(na, nb, err_msg=f"NaN positions differ {msg}")
    ba, bb = bits(np.where(na, 0, a)), bits(np.where(nb, 0, b))
    bad = np.flatnonzero(ba != bb)
    assert bad.size == 0, f"{bad.size} of {a.size} differ {msg}: first at {bad[:5]}: {a.flat[bad[:5]]} vs {b.flat[bad[:5]]}"


