"""Number formats and the pure functions that quantize to them (ONNX QuantizeLinear semantics)."""
from .granularity import PER_TENSOR, Granularity, per_channel, per_group
from .qformat import BF16, FORMATS, FP8_E4M3, FP8_E5M2, FP16, FP32, INT4, INT8, INT16, INT32, UINT4, UINT8, QFormat, get_format
from .qparams import choose_qparams, code_range
from .functional import dequantize, fake_quantize, quantize

__all__ = [
    "QFormat", "get_format", "FORMATS", "INT8", "UINT8", "INT4", "UINT4", "INT16", "INT32", "FP8_E4M3", "FP8_E5M2",
    "FP16", "BF16", "FP32", "Granularity", "PER_TENSOR", "per_channel", "per_group", "choose_qparams",
    "code_range", "quantize", "dequantize", "fake_quantize",
]
