"""QDQ ONNX export of QAT models (``dal.export_onnx``); the contract is ``export/SPEC.md``."""
from .api import export_onnx
from .attention_mask import additive_attention_mask
from .errors import ExportError

__all__ = ["export_onnx", "ExportError", "additive_attention_mask"]
