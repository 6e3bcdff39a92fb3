"""Quantized codes as numbers: torch tensors to numpy (float8 included) and codes to grid steps.

numpy has no float8 type; ``ml_dtypes`` does (what dal.npu and onnx use). A float8 code's
distance to another is counted in grid steps, as an integer code's is in LSBs: the ordinal of a
float8 code is its position on the format's ordered grid, ``+m`` for a positive code whose bits
below the sign are ``m`` and ``-m`` for a negative one (sign-magnitude: ``+0`` and ``-0`` are both
0; adjacent representable values are 1 apart, e.g. 1.0 and 1.125 in e4m3fn). NaN has no place on
the grid: its ordinal is the magnitude bits too (0x7F in e4m3fn, past the largest finite 0x7E), so
a NaN against the largest finite value counts 1 step; callers that must tell NaN apart compare bits.
"""
from __future__ import annotations

import numpy as np
import torch

#: torch's float8 dtypes and the ml_dtypes type of the same name (ONNX float8e4m3fn / e5m2 / ...fnuz)
TORCH_FLOAT8 = {getattr(torch, n): n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n)}


#: the ml_dtypes float8 dtype names (their numpy ``kind`` differs: ``V`` for e4m3fn, ``f`` for e5m2)
FLOAT8_NAMES = frozenset(TORCH_FLOAT8.values()) | {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


def is_float8(arr) -> bool:
    """True for an ``ml_dtypes`` float8 array or dtype (told by the dtype's name)."""
    dt = arr if isinstance(arr, np.dtype) else np.asarray(arr).dtype
    return dt.itemsize == 1 and dt.name in FLOAT8_NAMES


def is_code(arr) -> bool:
    """True for integer codes (numpy ``i`` / ``u`` kinds, int4 included) and float8 codes."""
    dt = np.asarray(arr).dtype
    return dt.kind in "iu" or is_float8(arr) or dt.name in ("int4", "uint4")


def as_numpy(t) -> np.ndarray:
    """A tensor or array as numpy; a torch float8 tensor as the ``ml_dtypes`` array of the same
    bits (``torch.float8_e4m3fn`` -> ``ml_dtypes.float8_e4m3fn``)."""
    if not torch.is_tensor(t):
        return np.asarray(t)
    t = t.detach().cpu()
    kind = TORCH_FLOAT8.get(t.dtype)
    if kind is None:
        return t.numpy()
    import ml_dtypes

    return t.contiguous().view(torch.uint8).numpy().view(getattr(ml_dtypes, kind))


def ordinals(arr) -> np.ndarray:
    """int64 grid positions of codes: integer codes as themselves, float8 codes by the module
    doc's sign-magnitude ordinal; so ``|ordinals(a) - ordinals(b)|`` is the distance in LSBs / grid steps."""
    a = np.asarray(arr)
    if is_float8(a):
        bits = np.ascontiguousarray(a).view(np.uint8).astype(np.int64)
        mag = bits & 0x7F
        return np.where(bits & 0x80, -mag, mag)
    return a.astype(np.int64)


def as_torch(arr) -> torch.Tensor:
    """The inverse of :func:`as_numpy`: an ``ml_dtypes`` float8 array as the torch float8 tensor
    of the same bits, any other array as ``torch.from_numpy`` of it."""
    a = np.ascontiguousarray(arr)
    if is_float8(a):
        dtype = next(d for d, n in TORCH_FLOAT8.items() if n == a.dtype.name)
        return torch.from_numpy(a.view(np.uint8).copy()).view(dtype)
    return torch.from_numpy(a.copy())
