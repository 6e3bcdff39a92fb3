"""Parity reports: the NPU reference against the torch QAT model and onnxruntime."""
from .api import verify
from .inputs import VerifyInputError
from .metrics import Agreement, agreement
from .report import LayerParity, ParityReport

__all__ = ["verify", "VerifyInputError", "ParityReport", "LayerParity", "Agreement", "agreement"]
