"""Which weighted layers the NPU runs as one integer group: a probe forward of the QAT model.

The NPU fuses ``DQ -> Conv/Gemm/MatMul [-> Add(int32 bias)] [-> Relu/Clip] -> Q`` when the
layer's output (after at most one Relu/Clip) is read by one QuantizeLinear, or only by k >= 2
of them (a fan-out group: the exact accumulator is requantized once per reader, export/SPEC.md),
and is no graph output (the bias Add is inside the torch layer: layers.py decides it); a layer
whose output also feeds a float op runs in float. One max pool or nearest interpolate may sit
before the quantizer(s) (ResNet's stem: Conv -> Relu -> MaxPool -> {Q, Q}): the group's codes
are pooled / resized, which is exact since the requantizer is non-decreasing (``pass_through``). The same
structure is read here from the torch model itself, with no ONNX file: one forward of the QAT
model captured by :mod:`dal.capture` (every FakeQuantizer and weighted layer opaque) gives every
torch function called outside a quantizer or a weighted layer and which values it read and
wrote, plus every FakeQuantizer and weighted-layer call (:class:`Event`). In-place functions
(``relu_``) write a new version of their input. Calls whose result is not a tensor (``x.shape``,
``x.size()``) are shape queries, which the ONNX graph does not have, and are not recorded.
``x + 0`` and ``x * 1`` with a Python int pass the value through: the exporter drops them
(``exporter_drops``).

Which calls belong to which op is the op registry's (dal.ops, read through op_forms.py, on first
use); what the probe makes of an op (a Relu / Clip's bounds, an op that leaves no node, the
neutral int of add / sub / mul, a pass-through's argument check) is kept here, keyed by op name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..capture import Record, recording
from ..quantizer import FakeQuantizer
from .op_forms import Derived, calls_of, in_place, in_place_variant, per_registry, reflected


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    return name if isinstance(name, str) else ""


def _relu_bounds(func, args, kwargs):
    return (0.0, None)


def _relu6_bounds(func, args, kwargs):
    return (0.0, 6.0)


def _hardtanh_bounds(func, args, kwargs):
    """``F.hardtanh(x, min_val=-1, max_val=1)``, or the op's clamp spelling ``torch.clamp(x,
    min=None, max=None)`` (``clip``, in place or not)."""
    if _name(func).startswith("hardtanh"):
        lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
        hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
    else:
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
    return lo, hi


#: the ops the exporter writes as one Relu / Clip, keyed by op name (dal.ops), with how a
#: call's (lo, hi) bounds are read from its arguments
_BOUNDS = {"relu": _relu_bounds, "relu6": _relu6_bounds, "hardtanh": _hardtanh_bounds}
#: the ops that leave no node in an eval-mode export (the value passes through), by op name
_NO_NODE = ("dropout", "identity")


@per_registry
def _act_table(ops) -> dict:
    """{callable: op name} of the ``_BOUNDS`` ops, their in-place spellings included (``relu_``,
    ``torch.clamp_``, ``F.hardtanh_``: an in-place call writes a new version of its input)."""
    return {g: op.name for op in ops if op.name in _BOUNDS for f in calls_of(op)
            for g in (f, in_place_variant(f)) if g is not None}


@per_registry
def _pass_table(ops) -> frozenset:
    return frozenset(f for op in ops if op.name in _NO_NODE for f in calls_of(op))


@per_registry
def _arith_table(ops) -> dict:
    """{callable: op} of the out-of-place calls of the ops with a ``neutral`` int (dal.ops; a
    reflected call only where ``n op x == x``: ``0 + x``, not ``0 - x``)."""
    return {f: op for op in ops if op.neutral is not None for f in calls_of(op)
            if not in_place(f) and (op.neutral[1] or not reflected(f))}


#: functions the exporter writes as Relu / Clip -> their op's name (derived from dal.ops)
_ACT = Derived(_act_table)
#: functions that leave no node in an eval-mode export (the value passes through)
_PASS = Derived(_pass_table)
#: out-of-place arithmetic whose call with its op's neutral Python int (alpha 1) the exporter drops
_ARITH = Derived(_arith_table)


@dataclass
class Event:
    """One call the plans walk (:func:`_events`): a torch function, a quantizer or a weighted
    layer, the value keys (dal.capture) it read and wrote, a function's arguments."""

    kind: str          # "func", "quant" or "layer"
    obj: Any           # the function, the FakeQuantizer, or the weighted layer
    ins: list          # value keys read
    outs: list         # value keys written
    args: tuple = ()
    kwargs: Optional[dict] = None


@dataclass
class GroupPlan:
    """One call of a weighted layer: fused (with the consumer quantizer and the Relu/Clip
    bounds in between) or float."""

    fused: bool
    consumer: Optional[FakeQuantizer] = None
    act: Optional[tuple] = None   # (lo, hi) of an external Relu/Clip, None bounds unbounded
    why: str = ""
    consumers: tuple = ()         # every reader's quantizer (k >= 2: a fan-out group), else ()

    @property
    def readers(self) -> tuple:
        """The quantizers whose codes the group computes, one requantizer each."""
        return self.consumers or ((self.consumer,) if self.consumer is not None else ())


def _bounds(kind, func, args, kwargs):
    """(lo, hi) of a call of the Relu / Clip op named ``kind`` (``_BOUNDS``), or None when a bound
    is a tensor (no constant Clip)."""
    lo, hi = _BOUNDS[kind](func, args, kwargs or {})
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        return None
    return (None if lo is None else float(lo), None if hi is None else float(hi))


def _is_int_per_tensor(q) -> bool:
    return (isinstance(q, FakeQuantizer) and q.fmt.is_integer and q.state in ("quantize", "frozen")
            and q.initialized and q.granularity.axis is None)


def _events(rec: Record) -> list[Event]:
    """The events of a record: every function call (``"func"``) and every opaque module call, a
    quantizer's (``"quant"``) or a weighted layer's (``"layer"``), in completion order. A
    transparent module's call is no event: it writes no value (its outputs are the values the
    calls inside it wrote)."""
    found = []
    for c in rec.calls:
        if c.kind == "function":
            found.append(Event("func", c.target, list(c.ins), list(c.outs), c.args, c.kwargs))
        elif c.opaque:
            kind = "quant" if isinstance(c.target, FakeQuantizer) else "layer"
            found.append(Event(kind, c.target, list(c.ins), list(c.outs)))
    return found


def record(model: nn.Module, args: tuple, kwargs: dict, layers: list) -> tuple[list, set]:
    """(events, output keys) of one forward of ``model`` under ``torch.no_grad`` (dal.capture,
    arguments kept: the plans read a Relu / Clip's bounds and a pool's arguments from them);
    every FakeQuantizer and ``layers`` are opaque."""
    ids = set(map(id, layers))
    with torch.no_grad(), recording(model, opaque=lambda m: isinstance(m, FakeQuantizer) or id(m) in ids,
                                    keep_args=True) as rec:
        model(*args, **kwargs)
    return _events(rec), set(rec.outputs)  # the root's tensor leaves, any nest (dal.nest)


def plan_groups(events: list, outputs: set) -> dict[int, list[GroupPlan]]:
    """{id(layer): [GroupPlan per call, in call order]} (see the module docstring)."""
    readers: dict[int, list[Event]] = {}
    for e in events:
        for k in e.ins:
            readers.setdefault(k, []).append(e)
    plans: dict[int, list[GroupPlan]] = {}
    for e in events:
        if e.kind == "layer":
            plans.setdefault(id(e.obj), []).append(_chain(e, readers, outputs))
    return plans


def _chain(e: Event, readers: dict, outputs: set) -> GroupPlan:
    layer = getattr(e.obj, "qat", e.obj)  # an IntegerLayer holds the QAT layer
    own = getattr(layer, "output_quant", None)
    if own is not None and own.state != "off":
        return GroupPlan(True, own) if _is_int_per_tensor(own) else GroupPlan(False, why="output quantizer")
    # a pass-through only after a Conv: its per-channel requantizers never meet in one window
    act, passed, conv = None, False, getattr(e.obj, "kind", None) == "conv"
    has_act = getattr(layer, "activation", None) is not None
    key = e.outs[0] if len(e.outs) == 1 else None
    while key is not None:
        if key in outputs:
            return GroupPlan(False, why="a graph output")
        users = readers.get(key, [])
        if len(users) >= 2:  # a fan-out group when every reader quantizes (export/SPEC.md)
            qs = [_reader_quant(u) for u in users]
            if len({id(u) for u in users}) == len(users) and all(q is not None and _is_int_per_tensor(q) for q in qs):
                return GroupPlan(True, qs[0], act, consumers=tuple(qs))
        if len(users) != 1:
            return GroupPlan(False, why=f"read by {len(users)} operations")
        u = users[0]
        if u.kind == "func" and (u.obj in _PASS or exporter_drops(u.obj, u.args, u.kwargs)):
            key = u.outs[0]
            continue
        if u.kind == "func" and conv and not passed and pass_through(u.obj, u.args, u.kwargs):
            passed = True  # requantize, then pool / resize the codes: the same (module doc)
            key = u.outs[0] if len(u.outs) == 1 else None
            continue
        if u.kind == "func" and u.obj in _ACT and not has_act and act is None and not passed:
            act = _bounds(_ACT[u.obj], u.obj, u.args, u.kwargs)
            if act is None:
                return GroupPlan(False, why="Clip with tensor bounds")
            key = u.outs[0]
            continue
        q = _reader_quant(u)
        if q is not None and _is_int_per_tensor(q):
            return GroupPlan(True, q, act)
        if q is not None and not q.fmt.is_scaled:  # an FP16 island's input (dal.prepare.fp16_island)
            return GroupPlan(False, why=f"read by an {q.fmt.name.upper()} quantizer ({q.name})")
        return GroupPlan(False, why=f"read by {getattr(u.obj, '__name__', type(u.obj).__name__)}")
    return GroupPlan(False, why="no single output")


def _is_int(v, value) -> bool:
    return type(v) is int and v == value  # a bool or a float 0.0 / 1.0 stays a node


def exporter_drops(func, args, kwargs) -> bool:
    """True for ``x + 0``, ``0 + x``, ``x - 0`` (alpha absent or the int 1) and ``x * 1``,
    ``1 * x`` with a Python int and ``x`` a tensor, out of place: the TorchScript exporter's
    peephole pass removes these, so the file has no node there and a weighted layer's output
    reaches its quantizer directly (an integer group: timm's MobileOne / FastViT branches sum
    ``scale_out + identity_out`` with an absent branch as the int 0). A float ``0.0`` / ``1.0``,
    a division, another alpha and the in-place ``x += 0`` stay nodes."""
    op = _ARITH.get(func)
    kwargs = kwargs or {}
    if op is None or len(args) != 2 or not isinstance(args[0], torch.Tensor) or set(kwargs) - {"alpha"}:
        return False
    if op.name == "mul" and kwargs:
        return False
    return _is_int(args[1], op.neutral[0]) and _is_int(kwargs.get("alpha", 1), 1)


def _max_pool_args(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                   return_indices=False):
    k = (kernel_size,) * 2 if isinstance(kernel_size, int) else tuple(kernel_size)
    p = (padding,) * 2 if isinstance(padding, int) else tuple(padding)
    d = (dilation,) * 2 if isinstance(dilation, int) else tuple(dilation)
    return (len(k) == 2 and input.ndim == 4 and not ceil_mode and not return_indices
            and all(v == 1 for v in d) and all(0 <= pv < kv for pv, kv in zip(p, k)))


def _interpolate_args(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                      recompute_scale_factor=None, antialias=False):
    return mode in ("nearest", "nearest-exact") and input.ndim == 4


def _is_max_pool2d(func) -> bool:
    """The max_pool op's 2-D spelling, whose arguments ``_max_pool_args`` reads (``max_pool1d`` /
    ``3d`` and the adaptive pools take others)."""
    return func is F.max_pool2d


#: the element-picking ops (by op name) that commute with the requantizer: which of the op's
#: callables pick elements of a 2-D map, and the check of a call's arguments
_PICKERS = {"max_pool": (_is_max_pool2d, _max_pool_args), "resize": (callable, _interpolate_args)}


@per_registry
def _pick_table(ops) -> dict:
    return {f: _PICKERS[op.name][1] for op in ops if op.name in _PICKERS for f in calls_of(op)
            if _PICKERS[op.name][0](f)}


def picked_calls() -> frozenset:
    """The callables whose calls may pass a group's codes through (:func:`pass_through`):
    ``F.max_pool2d`` and ``F.interpolate`` (NPUFloatOps follows a fan-out's values through them)."""
    return frozenset(_pick_table())


def pass_through(func, args, kwargs) -> bool:
    """A call that only picks elements and commutes with the requantizer (non-decreasing per
    channel): a 2-D max pool (no indices, dilation 1, no ceil mode, padding < kernel: every
    window holds an element) or a nearest interpolate; the NPU's MaxPool / nearest Resize
    pass-through (export/SPEC.md §5a)."""
    check = _pick_table().get(func)
    try:
        return bool(check is not None and check(*args, **(kwargs or {})))
    except TypeError:
        return False


def _reader_quant(u: Event):
    """The quantizer through which event ``u`` reads its input: a FakeQuantizer call itself, or
    a weighted layer's own input quantizer (IntegerLayer: ``.qat``); None for anything else."""
    if u.kind == "quant":
        return u.obj
    if u.kind == "layer":
        return getattr(getattr(u.obj, "qat", u.obj), "input_quant", None)
    return None
