"""Calibration: observers see real data before QAT (or instead of it, for PTQ).

(The package is not called ``calibrate`` so that ``dal.calibrate`` is always the function.)
"""
from .batches import check_finite_inputs, model_inputs
from .loop import METHODS, calibrate

__all__ = ["calibrate", "METHODS", "model_inputs", "check_finite_inputs"]
