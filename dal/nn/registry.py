"""The QAT module of a float module type, read from the op registry (:mod:`dal.ops`).

One store: an op of :mod:`dal.ops` with ``handling="quantize"``, float ``modules`` and a
``qat_module`` maps each of those types to that QAT class (dal.nn's own drop-ins are declared
by the family files, a user's by ``@dal.ops.register``). :data:`QAT_MODULES` and
:data:`OP_CLASSES` are read-only views of it; :func:`register_qat_module` registers through it.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Callable, Iterator

from torch import nn

from .. import ops as _ops
from ..hardware.op_classes import ALL_OP_CLASSES, check_op_class
from .adopt import float_class_of


def _quantize_op(float_type):
    """The registry's op that swaps ``float_type`` for a QAT module, or None. An op whose
    ``op_class`` is neither a hardware op class nor ``"custom"`` is a ValueError naming it (a
    recipe rule could never quantize it: it would stay float without a word)."""
    op = _ops.by_module(float_type) if isinstance(float_type, type) else None
    if op is None or op.handling != "quantize" or op.qat_module is None:
        return None
    if op.op_class != "custom" and op.op_class not in ALL_OP_CLASSES:
        try:
            check_op_class(op.op_class)
        except ValueError as err:
            raise ValueError(f"dal.ops op {op.name!r} (float type {float_type.__qualname__}): {err}") from None
    return op


class _ModuleView(Mapping):
    """float type -> ``value(op)`` for every float type of a quantize op of the registry (live)."""

    def __init__(self, value: Callable, doc: str):
        self._value, self.__doc__ = value, doc

    def __getitem__(self, float_type):
        op = _quantize_op(float_type)
        if op is None:
            raise KeyError(float_type)
        return self._value(op)

    def __contains__(self, float_type) -> bool:
        return _quantize_op(float_type) is not None

    def __iter__(self) -> Iterator[type]:
        return iter([t for op in _ops.all_ops() for t in op.modules if _quantize_op(t) is op])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{t.__name__}: {self[t]!r}' for t in self)}}}"


#: float type -> QAT class (a read-only view of :mod:`dal.ops`)
QAT_MODULES: Mapping = _ModuleView(lambda op: op.resolve("qat_module"), "float type -> QAT class")
#: float type -> hardware op class ("conv", "linear", ...) used to match recipes and hardware
OP_CLASSES: Mapping = _ModuleView(lambda op: op.op_class, "float type -> hardware op class")


def register_qat_module(float_type: type, op_class: str = "custom") -> Callable[[type], type]:
    """Register ``cls`` as the QAT version of ``float_type``: ``dal.ops.register(float_type,
    op_class=op_class, handling="quantize")`` under the name ``"<module>.<qualname>"`` of
    ``float_type``, for a class derived from :class:`dal.nn.QATModule`.

    The class needs ``from_float(mod, spec, name) -> module`` and ``to_float() -> module``;
    ``op_class`` names the hardware operator class its recipe rules and hardware checks use.
    Registering ``float_type`` again with this function replaces the earlier class; a family
    file's op that already declares this very class (``qat_module="<module>:<class>"``) is kept
    as it is; a type another op matches is refused, naming both. ``@dal.ops.register`` is the
    fuller form (export, convert and cost fields too).

        @dal.register_qat_module(MyAttention, op_class="matmul")
        class QMyAttention(MyAttention): ...
    """
    if not (isinstance(float_type, type) and issubclass(float_type, nn.Module)):
        raise TypeError(f"register_qat_module needs an nn.Module subclass, got {float_type!r}")

    def wrap(cls):
        from .base import QATModule

        if not (isinstance(cls, type) and issubclass(cls, QATModule)):
            raise TypeError(f"{getattr(cls, '__name__', cls)} cannot be registered for {float_type.__name__}: a QAT "
                            f"class derives from dal.nn.QATModule (class Q{float_type.__name__}(dal.nn.QATModule, "
                            f"{float_type.__name__}): ...), which gives it from_float / to_float / quantizers")
        name = f"{float_type.__module__}.{float_type.__qualname__}"
        op = _ops.by_module(float_type)
        if op is not None and op.qat_module == f"{cls.__module__}:{cls.__qualname__}":
            return cls  # the family file declares this class for float_type already
        if op is not None and op.name == name:
            _ops.unregister(name)  # this function registered float_type before: the new class replaces it
        return _ops.register(float_type, name=name, op_class=op_class, handling="quantize")(cls)
    return wrap


#: (defining package, class name) -> the torch.nn class a library subclass computes exactly. timm's
#: Linear overrides forward only for TorchScript (outside scripting it is F.linear(x, W, b)); it is
#: the classifier of timm's MobileNetV3, GhostNet, EfficientNet-Lite and more.
EQUIVALENT_TYPES: dict[tuple[str, str], type] = {("timm.layers", "Linear"): nn.Linear}

#: (defining module, class name) -> the dal module that registers a QAT class for it, imported the
#: first time such a class is looked up (so ``import dal`` never imports peft).
LAZY_QAT_MODULES: dict[tuple[str, str], str] = {("peft.tuners.lora.layer", "Linear"): "dal.nn.lora",
                                                 ("transformers.pytorch_utils", "Conv1D"): "dal.nn.hf_conv1d"}


def registry_type(cls: type) -> type:
    """The type the registry knows ``cls`` by: itself (exact match; a class of ``LAZY_QAT_MODULES``
    after importing the dal module that registers it), or the torch.nn class of
    ``EQUIVALENT_TYPES`` for a known library subclass with the same computation."""
    if cls in QAT_MODULES:
        return cls
    lazy = LAZY_QAT_MODULES.get((cls.__module__, cls.__name__))
    if lazy is not None:
        importlib.import_module(lazy)  # registers cls's QAT class
        if cls in QAT_MODULES:
            return cls
    for (package, name), base in EQUIVALENT_TYPES.items():
        if cls.__name__ == name and cls.__module__.startswith(package) and issubclass(cls, base):
            return base
    return cls


def qat_class_for(mod: nn.Module):
    """The registered QAT class for ``type(mod)`` (exact type match, or ``registry_type``), or None."""
    return QAT_MODULES.get(registry_type(type(mod)))


def is_qat_module(mod: nn.Module) -> bool:
    """``isinstance(mod, dal.nn.QATModule)``: dal.nn's drop-ins, dal.replace's modules, the user's."""
    from .base import QATModule

    return isinstance(mod, QATModule)


def op_class_of(mod: nn.Module) -> str:
    """Hardware op class of a float or QAT module ("conv", "linear", "add", ...)."""
    if hasattr(mod, "op_class"):
        return mod.op_class
    float_cls = float_class_of(mod) or type(mod)
    return OP_CLASSES.get(registry_type(float_cls), "custom")


def float_type_name(mod: nn.Module) -> str:
    """Name of the float type a recipe rule matches ("Conv2d" for QConv2d and fused Conv+BN)."""
    float_cls = float_class_of(mod)
    if float_cls is not None:
        return float_cls.__name__
    return getattr(mod, "op_class", type(mod).__name__) if hasattr(mod, "op_class") else type(mod).__name__
