"""dal.convert -- the deployed integer model in torch (the chip's arithmetic, exact).

    int_model = dal.convert(qat_model)     # the module is callable: dal.convert(...) converts
    y = int_model(x)

Derived from the trained torch model only; it never imports dal.npu (and dal.npu never
imports it), so integer model == dal.npu is a cross-check of trainer, exporter and reference.
"""
from __future__ import annotations

import sys
import types

from .api import IntegerModel, Requantizer, convert
from .errors import ConvertError

__all__ = ["convert", "IntegerModel", "ConvertError", "Requantizer"]


class _CallableModule(types.ModuleType):
    """``dal.convert`` names both this package and the function: once ``import dal.convert``
    has bound the package to that attribute, ``dal.convert(model)`` must still convert."""

    def __call__(self, *args, **kwargs):
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
