"""dal.capture: the one recorded forward every stage reads (prepare's example run, dal.convert's
integer groups, the cost model): module and function calls, call sites, values, shapes, dtypes.
See :mod:`dal.capture.recorder` for the mechanism and why, and :mod:`dal.capture.record` for what
a record holds."""
from .record import Call, Entry, Record, TensorMeta
from .recorder import capture, capturing, recording

__all__ = ["Call", "Entry", "Record", "TensorMeta", "capture", "capturing", "recording"]
