"""FP16 islands: the float ops of an engine that computes in fp16 (``engines.<name>.compute:
fp16`` in the hardware model, e.g. the a2000's vector engine).

Such an engine dequantizes int8 codes to fp16 on load, runs its float op on fp16 values and
rounds the result to fp16 before it requantizes on store. So a float op prepare leaves between
quantizers (an activation in ``fp16_ops``, average pooling, a non-nearest resize, a float
softmax) trains as

    y = q16(f(q16(x)))          q16: FakeQuantizer("fp16"), the FP16 cast round trip

and is exported as ``Cast(FLOAT16) -> Cast(FLOAT) -> f -> Cast(FLOAT16) -> Cast(FLOAT)``
(export/SPEC.md §5a "Precision", §6), which dal.npu and dal.convert compute by the §5a rules.
``f`` itself is the float module or function, unchanged (its float32 result rounded once more
to fp16): the file states the precision at the island's edges.

A float module becomes ``Fp16<Type>`` (its own class with :class:`Fp16Island` first, the same
attributes and Parameters: ``to_float()`` gives the module back); a float function in a traced
forward becomes an :class:`Fp16Function` module called in its place.

Hardswish and Hardsigmoid islands (nn.Hardswish / nn.Hardsigmoid exactly, or F.hardswish /
F.hardsigmoid) take ``dal.formats.island.fused_island`` when both round trips are plain
quantizing FP16 FakeQuantizers without hooks: the same bits, forward and backward, in one pass
each instead of three ops, two fresh tensors and three autograd nodes (MobileNetV3: 20
Hardswish islands, 5.7 M values per SSDlite step). Anything else, and wherever that function
declines (its doc), runs the ops one by one.
"""
from __future__ import annotations

import functools
from typing import Callable, Union

from torch import nn
from torch.nn.modules import module as _torch_module

from .. import ops
from ..formats import FP16, island
from ..formats.island import fused_island
from ..nn.adopt import adopt, float_class_of, release
from ..nn.base import QATModule
from ..quantizer import FakeQuantizer
from .float_ops import relu_like

#: the op classes whose float ops become FP16 islands on an fp16 engine (export/SPEC.md §5a)
ISLAND_CLASSES = ("activation", "pool", "resize", "softmax")
_CLASSES: dict[type, type] = {}


@functools.cache
def fused_modules() -> dict[type, str]:
    """Exact float module type -> the op an island of it computes in one fused pass: the modules
    of the ops dal.formats.island fuses (``island.OPS``: hardswish, hardsigmoid; dal.ops)."""
    return {t: name for name in island.OPS for t in ops.get(name).modules}


@functools.cache
def fused_functions() -> dict:
    """Float function -> the op an :class:`Fp16Function` of it computes in one fused pass: the
    functions of the ops dal.formats.island fuses (``F.hardswish``, ``F.hardsigmoid``)."""
    return {f: name for name in island.OPS for f in ops.get(name).functions}


def is_island(hw, float_op) -> bool:
    """Whether the float op ``float_op`` (a ``float_ops.FloatOp`` the hardware runs) is an FP16
    island on ``hw``: a float op of an :data:`ISLAND_CLASSES` class whose engine computes in
    fp16 (``hw.compute_precision(op_class) == "fp16"``). Relu-like ops are exact on codes."""
    if float_op is None or float_op.kind != "float" or float_op.op_class not in ISLAND_CLASSES:
        return False
    if relu_like(float_op.function):
        return False
    precision = getattr(hw, "compute_precision", None)
    return precision is not None and precision(float_op.op_class) == "fp16"


class _IslandEdges(QATModule):
    """What every FP16 island has: an FP16 quantizer on its input and on its output."""

    #: the exporter writes the op itself in float32 between the round trips (no FP16 region)
    fp16_island = True

    def _init_island(self, name: str, op_class: str) -> None:
        self.qat_name, self.activation, self.bias_mode = name, None, "float"
        self.island_op_class, self.weight_quant = op_class, None
        self.input_quant = FakeQuantizer("fp16", name=f"{name}.input_quant")
        self.output_quant = FakeQuantizer("fp16", name=f"{name}.output_quant")

    @property
    def op_class(self) -> str:
        return self.island_op_class

    def quantizers(self) -> dict:
        return {"input_quant": self.input_quant, "output_quant": self.output_quant}

    def _fused(self, op, x):
        """``fused_island(x, op)`` where the two round trips are plain quantizing FP16 quantizers
        that no hook watches (a hook would miss its call), else None: the ops one by one."""
        if op is None:
            return None
        for q in (self.input_quant, self.output_quant):
            if type(q) is not FakeQuantizer or q.fmt != FP16 or not q.state.quantizes \
                    or q._forward_hooks or q._forward_pre_hooks:
                return None
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return None
        return fused_island(x, op)


class Fp16Island(_IslandEdges):
    """``output_quant(forward(input_quant(x), ...))`` with FP16 round trips; mixed in before a
    float module's class (``Fp16SiLU(Fp16Island, nn.SiLU)``)."""

    def to_float(self) -> nn.Module:
        return release(self, drop=("island_op_class", "weight_quant"))

    #: the fused op of this class's float module (``island_class`` sets it), or None
    fused_op = None

    def __reduce_ex__(self, protocol):
        # The class is made at run time (island_class), so pickle cannot find it by name: the
        # pickle names the float class instead, and loading makes (or finds) the island class
        # of that again. The state is the module's own, as for any nn.Module.
        reduced = super().__reduce_ex__(protocol)
        return (_new_island, (float_class_of(self),)) + tuple(reduced[2:])

    def forward(self, x, *args, **kwargs):
        y = None if args or kwargs else self._fused(self.fused_op, x)
        if y is not None:
            return y
        return self.output_quant(super().forward(self.input_quant(x), *args, **kwargs))


def island_module(mod: nn.Module, name: str, op_class: str) -> nn.Module:
    """The FP16 island of float module ``mod`` (same Parameters and attributes; quantizers are
    identities until dal.calibrate moves them on, like every quantizer)."""
    q = adopt(island_class(type(mod)), mod)
    q._init_island(name, op_class)
    return q


def island_class(base: type) -> type:
    """``Fp16<base>``: the class of ``base``'s FP16 islands (:class:`Fp16Island` first, then
    ``base``), made once per process and float class."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Fp16{base.__name__}", (Fp16Island, base),
                                    {"__doc__": f"{base.__name__} as an FP16 island (dal.prepare.fp16_island).",
                                     "fused_op": fused_modules().get(base)})
    return cls


def _new_island(base: type) -> nn.Module:
    """An empty instance of ``base``'s island class, for pickle to set the state of (``Fp16Island.__reduce_ex__``)."""
    cls = island_class(base)
    return cls.__new__(cls)


class Fp16Function(_IslandEdges):
    """``output_quant(fn(input_quant(x), *args, **kwargs))``: a float function of a traced forward
    (``torch.sigmoid``, ``F.avg_pool2d``, ``x.mean(...)``) as an FP16 island; ``fn`` is the
    callable or, for a method call, its name."""

    swappable = False  # built for a graph node, not from a float module

    def __init__(self, fn: Union[Callable, str], name: str, op_class: str):
        super().__init__()
        self.fn = fn
        self._init_island(name, op_class)

    def forward(self, x, *args, **kwargs):
        # F.hardswish(x) / F.hardsigmoid(x[, inplace]): the input is not the caller's either way
        op = fused_functions().get(self.fn) if not args and set(kwargs) <= {"inplace"} else None
        y = self._fused(op, x)
        if y is not None:
            return y
        x = self.input_quant(x)
        y = getattr(x, self.fn)(*args, **kwargs) if isinstance(self.fn, str) else self.fn(x, *args, **kwargs)
        return self.output_quant(y)

    def extra_repr(self) -> str:
        return f"{getattr(self.fn, '__name__', self.fn)}, fp16 island"
