"""The one error type of dal.convert: its message names the layer (module path) at fault."""
from __future__ import annotations


class ConvertError(ValueError):
    """A QAT model that has no integer form as asked: never calibrated, quantizers still
    observing, or a layer the integer model cannot compute as the NPU does."""
