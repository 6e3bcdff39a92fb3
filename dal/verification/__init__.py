"""Parity reports: the NPU reference against the torch QAT model and onnxruntime."""
from .api import verify
from .decoder import DecoderReport, verify_decoder
from .inputs import VerifyInputError
from .metrics import Agreement, agreement
from .report import LayerParity, ParityReport

__all__ = ["verify", "verify_decoder", "DecoderReport",
           "VerifyInputError", "ParityReport", "LayerParity", "Agreement", "agreement"]
