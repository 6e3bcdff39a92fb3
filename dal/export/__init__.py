"""QDQ ONNX export of QAT models (``dal.export_onnx``); the contract is ``export/SPEC.md``."""
from .api import export_onnx
from .errors import ExportError

__all__ = ["export_onnx", "ExportError"]
