"""Observers: statistics of tensors -> (scale, zero_point), for any format and granularity."""
from .base import Observer
from .histogram import HistogramObserver, KLObserver, MSEObserver, PercentileObserver
from .minmax import MinMaxObserver, MovingAverageMinMaxObserver
from .registry import OBSERVERS, make_observer, register_observer

__all__ = ["Observer", "MinMaxObserver", "MovingAverageMinMaxObserver", "HistogramObserver",
           "PercentileObserver", "KLObserver", "MSEObserver", "OBSERVERS", "make_observer", "register_observer"]
