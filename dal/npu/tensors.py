"""ONNX element types <-> numpy dtypes (ml_dtypes for int4/uint4/float8) and initializer loading."""
from __future__ import annotations

import numpy as np

from .errors import NPUError, UnsupportedNode


# ONNX element types no dal format uses: refused by name rather than half supported.
NOT_CLAIMED = {25: "UINT2", 26: "INT2", 23: "FLOAT4E2M1", 24: "FLOAT8E8M0", 27: "FLOAT6E2M3",
               28: "FLOAT6E3M2"}


def np_dtype(elem_type: int, node=None) -> np.dtype:
    """numpy dtype of an ONNX TensorProto element type; UnsupportedNode/NPUError if none, or
    if it is one of NOT_CLAIMED (int2, uint2, float4e2m1, float8e8m0, float6)."""
    from onnx import helper
    if int(elem_type) in NOT_CLAIMED:
        why = f"element type {NOT_CLAIMED[int(elem_type)]} is not a dal format (dal.npu does not implement it)"
        if node is not None:
            raise UnsupportedNode(node, [], why)
        raise NPUError(why)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(elem_type)))
    except Exception:
        if node is not None:
            raise UnsupportedNode(node, [], f"element type {elem_type} has no numpy dtype") from None
        raise NPUError(f"element type {elem_type} has no numpy dtype") from None


def load_initializer(t) -> np.ndarray:
    """numpy array of a TensorProto; NPUError naming it if the data is malformed."""
    from onnx import numpy_helper
    if t.data_location == 1:  # EXTERNAL: onnx.load resolved it when reading from a path
        raise NPUError(f"initializer {t.name!r} uses external data that was not loaded "
                       "(pass the model path so its data files can be found)")
    try:
        a = numpy_helper.to_array(t)
    except Exception as e:
        raise NPUError(f"initializer {t.name!r} is malformed: {e}") from None
    expect = int(np.prod(t.dims)) if len(t.dims) else 1
    if t.HasField("raw_data") and t.data_type in (21, 22) and len(t.raw_data) != (expect + 1) // 2:
        # UINT4 / INT4 pack two values a byte: onnx's unpacking would drop extra bytes silently
        raise NPUError(f"initializer {t.name!r} is malformed: {len(t.raw_data)} raw bytes for {expect} "
                       f"4-bit values (dims {list(t.dims)}) need {(expect + 1) // 2}")
    if a.size != expect:
        raise NPUError(f"initializer {t.name!r} holds {a.size} values for dims {list(t.dims)}")
    return a


def is_float(x) -> bool:
    """True for a float16 / float32 / float64 tensor (the types the float ops accept)."""
    return np.asarray(x).dtype in (np.float32, np.float16, np.float64)


def as_compute_type(x: np.ndarray) -> np.ndarray:
    """A float tensor in the type its ops are computed in: float16 widened to float32;
    float32 and float64 unchanged (see ops_float for the precision contract)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def type_name(x) -> str:
    return str(np.asarray(x).dtype) if x is not None else "none"
