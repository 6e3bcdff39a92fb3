"""Named number formats: the one place where ranges, element types and storage dtypes live.

Every other layer (fake quantizers, hardware models, recipes, the exporter) refers to a
format by its ``QFormat`` object or its name; nothing else restates a range.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# ONNX TensorProto element types, spelled out so that importing dal.formats does not import onnx.
_ONNX_FLOAT, _ONNX_UINT8, _ONNX_INT8, _ONNX_INT16, _ONNX_INT32 = 1, 2, 3, 5, 6
_ONNX_FLOAT16, _ONNX_BFLOAT16 = 10, 16
_ONNX_FLOAT8E4M3FN, _ONNX_FLOAT8E5M2 = 17, 19
_ONNX_UINT4, _ONNX_INT4 = 21, 22


@dataclass(frozen=True)
class QFormat:
    """A number format a tensor can be quantized to.

    Integer formats (``kind == "int"``) hold codes in ``[qmin, qmax]``; a real value is
    ``(code - zero_point) * scale``. Scaled float formats (``kind == "float8"``) hold
    ``x / scale`` rounded to the nearest representable value and saturated to ``+-max_value``
    (ONNX ``saturate=1``); their zero point is always 0. Plain float formats
    (``kind == "float"``: FP16, BF16) are a cast with no scale at all.

    Attributes:
        name: canonical lower-case name used in recipes and hardware models ("int8", "fp8_e4m3").
        kind: "int", "float8" or "float".
        bits: storage width in bits.
        signed: whether negative codes exist.
        qmin, qmax: smallest and largest code (integers) or -max/+max finite value (floats).
        onnx_type: the ONNX TensorProto element type of the quantized tensor.
        min_opset: the lowest ONNX opset whose QuantizeLinear/DequantizeLinear accepts it.
        torch_storage: name of the torch dtype that holds codes (int4 codes live in int8).
        numpy_storage: name of the numpy / ml_dtypes dtype of the ONNX tensor.
    """

    name: str
    kind: str
    bits: int
    signed: bool
    qmin: float
    qmax: float
    onnx_type: int
    min_opset: int
    torch_storage: str
    numpy_storage: str
    aliases: tuple[str, ...] = field(default=(), compare=False)

    @property
    def is_integer(self) -> bool:
        return self.kind == "int"

    @property
    def is_float8(self) -> bool:
        return self.kind == "float8"

    @property
    def is_scaled(self) -> bool:
        """True for formats that carry a scale (integers and FP8), False for FP16/BF16 casts."""
        return self.kind in ("int", "float8")

    @property
    def max_value(self) -> float:
        """Largest finite magnitude a code can represent (before scaling)."""
        return float(self.qmax)

    @property
    def levels(self) -> int:
        """Number of integer codes (integer formats only)."""
        if not self.is_integer:
            raise ValueError(f"format {self.name!r} is not an integer format; it has no level count")
        return int(self.qmax - self.qmin + 1)

    def torch_dtype(self):
        import torch

        return getattr(torch, self.torch_storage)

    def numpy_dtype(self):
        import numpy as np

        if self.numpy_storage in ("int4", "uint4", "float8_e4m3fn", "float8_e5m2", "bfloat16"):
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, self.numpy_storage))
        return np.dtype(self.numpy_storage)

    def __repr__(self) -> str:
        return f"QFormat({self.name})"


def _int(name, bits, signed, onnx_type, min_opset, storage, np_storage, aliases=()):
    qmin = -(1 << (bits - 1)) if signed else 0
    qmax = (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1
    return QFormat(name, "int", bits, signed, qmin, qmax, onnx_type, min_opset, storage, np_storage, aliases)


INT8 = _int("int8", 8, True, _ONNX_INT8, 10, "int8", "int8", ("s8", "qint8"))
UINT8 = _int("uint8", 8, False, _ONNX_UINT8, 10, "uint8", "uint8", ("u8", "quint8"))
INT4 = _int("int4", 4, True, _ONNX_INT4, 21, "int8", "int4", ("s4",))
UINT4 = _int("uint4", 4, False, _ONNX_UINT4, 21, "uint8", "uint4", ("u4",))
INT16 = _int("int16", 16, True, _ONNX_INT16, 21, "int16", "int16", ("s16",))
# Biases of integer layers: scale = input scale x weight scale, zero point 0 (DequantizeLinear, opset 10).
INT32 = _int("int32", 32, True, _ONNX_INT32, 10, "int32", "int32", ("s32",))
FP8_E4M3 = QFormat("fp8_e4m3", "float8", 8, True, -448.0, 448.0, _ONNX_FLOAT8E4M3FN, 19,
                   "float8_e4m3fn", "float8_e4m3fn", ("fp8_e4m3fn", "float8_e4m3fn", "e4m3"))
FP8_E5M2 = QFormat("fp8_e5m2", "float8", 8, True, -57344.0, 57344.0, _ONNX_FLOAT8E5M2, 19,
                   "float8_e5m2", "float8_e5m2", ("float8_e5m2", "e5m2"))
FP16 = QFormat("fp16", "float", 16, True, -65504.0, 65504.0, _ONNX_FLOAT16, 1,
               "float16", "float16", ("float16", "half"))
BF16 = QFormat("bf16", "float", 16, True, -3.3895313892515355e38, 3.3895313892515355e38,
               _ONNX_BFLOAT16, 13, "bfloat16", "bfloat16", ("bfloat16",))
FP32 = QFormat("fp32", "float", 32, True, -3.4028234663852886e38, 3.4028234663852886e38,
               _ONNX_FLOAT, 1, "float32", "float32", ("float32", "float"))

FORMATS: dict[str, QFormat] = {f.name: f for f in (INT8, UINT8, INT4, UINT4, INT16, INT32, FP8_E4M3, FP8_E5M2, FP16, BF16, FP32)}
_BY_ALIAS: dict[str, QFormat] = {a: f for f in FORMATS.values() for a in (f.name, *f.aliases)}


def get_format(fmt: "str | QFormat") -> QFormat:
    """Return the ``QFormat`` named ``fmt`` (case-insensitive, aliases allowed), or ``fmt`` itself.

    >>> get_format("INT8") is INT8
    True

    Raises ValueError naming the unknown value and listing the known names.
    """
    if isinstance(fmt, QFormat):
        return fmt
    if isinstance(fmt, str):
        found = _BY_ALIAS.get(fmt.strip().lower())
        if found is not None:
            return found
    raise ValueError(f"format={fmt!r} is not a known format; known formats: {', '.join(FORMATS)}")
