"""prepare_qat / to_float: turn a float model into a QAT model and back; dal.prepared(model)."""
from .api import prepare_qat
from .handle import Prepared, find_prepared, prepared
from .report import LayerRow, PrepareReport
from .state import freeze_bn, set_quantizer_state, to_float

__all__ = ["prepare_qat", "prepared", "find_prepared", "Prepared", "PrepareReport", "LayerRow",
           "set_quantizer_state", "freeze_bn", "to_float"]
