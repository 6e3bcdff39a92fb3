"""Number formats and the pure functions that quantize to them (ONNX QuantizeLinear semantics).

The format table (``qformat``) needs no torch; the functions are loaded on first use so that
``dal.hardware`` and ``dal.recipe`` (which only need format names) stay torch-free.
"""
import importlib

from .qformat import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, INT4, INT8, INT16, INT32, UINT4, UINT8, QFormat, get_format

_LAZY = {
    "Granularity": "granularity", "PER_TENSOR": "granularity", "per_channel": "granularity",
    "per_group": "granularity", "choose_qparams": "qparams", "code_range": "qparams",
    "quantize": "functional", "dequantize": "functional", "fake_quantize": "functional",
}

__all__ = [
    "QFormat", "get_format", "FORMATS", "INT8", "UINT8", "INT4", "UINT4", "INT16", "INT32", "FP8_E4M3", "FP8_E5M2",
    "FP16", "BF16", "FP32", *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
