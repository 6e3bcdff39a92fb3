"""Hardware models: what an NPU can do, loaded and validated from ``hardware_models/*.yaml``.

    >>> from dal.hardware import load_hardware
    >>> hw = load_hardware("a2000")
    >>> [f.name for f in hw.allowed_formats("linear", "weight")][:2]
    ['int4', 'int8']
"""
from dal.config.problems import ConfigError, Problem
from dal.config.vocabulary import GRANULARITIES
from dal.hardware.errors import HardwareModelError
from dal.hardware.load import list_hardware, load_hardware
from dal.hardware.model import ActivationRules, Engine, HardwareModel, OpSupport, Requantizer, WeightRules
from dal.hardware.op_classes import OP_CLASS_ROLES, OP_CLASSES, op_class_of_type

__all__ = [
    "ActivationRules", "ConfigError", "Engine", "GRANULARITIES", "HardwareModel", "HardwareModelError",
    "OP_CLASSES", "OP_CLASS_ROLES", "OpSupport", "Problem", "Requantizer", "WeightRules",
    "list_hardware", "load_hardware", "op_class_of_type",
]
