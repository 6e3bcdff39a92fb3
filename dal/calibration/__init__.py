"""Calibration: observers see real data before QAT (or instead of it, for PTQ).

(The package is not called ``calibrate`` so that ``dal.calibrate`` is always the function.)
"""
from .loop import calibrate

__all__ = ["calibrate"]
