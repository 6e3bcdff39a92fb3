"""Which LUT activation a module computes, found by running it, not by its class.

Libraries define their own activation classes (timm's ``GELU`` / ``SiLU`` / ``HardSwish`` /
``Sigmoid``, transformers' ``GELUActivation`` / ``NewGELUActivation`` / ``SiLUActivation``), so
``lut_activation`` cannot list them. A module is the activation ``f`` when

* it is a leaf with no parameters or buffers, defined outside torch and dal (torch's own classes
  are matched by type, ``lut.lut_types``), and
* run once, under ``torch.no_grad`` on a fixed probe (8193 points from -32 to 32, beyond a
  clipped GELU's usual +-10, as a ``[1, 1, 8193]`` tensor), it calls only elementwise torch
  functions (recorded by ``dal.capture``; a matmul, conv, reduction or random op rules it
  out) and returns a tensor
  of the probe's shape within ``1e-5 * (1 + |f(x)|)`` of ``f(x)`` at every point, for exactly one
  candidate ``f`` (GELU exact or tanh, SiLU, Sigmoid, Tanh, HardSwish, HardSigmoid).

GELU's exact and tanh forms differ by up to 5e-4 on the probe, HardSwish's torch and ONNX
formulas by an ulp, so the tolerance tells the forms apart and accepts a library's own spelling
of the same function (NewGELUActivation's explicit tanh formula).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from torch import nn

from ..capture import recording
from ..nn.tree import own_slots

TOLERANCE = 1e-5
#: calls that are not elementwise: any of them means the module is not a pointwise activation
_NOT_POINTWISE = ("matmul", "mm", "bmm", "linear", "conv", "sum", "mean", "softmax", "norm", "rand", "dropout",
                  "max", "min", "cat", "stack", "view", "reshape", "flatten", "permute", "transpose", "index")
_CACHE: "weakref.WeakKeyDictionary[nn.Module, Optional[tuple[str, str]]]" = weakref.WeakKeyDictionary()


def candidates() -> tuple[tuple[str, str], ...]:
    """The ``(function, GELU approximate)`` candidates, in the order tried: the LUT functions
    (``lut.FUNCTIONS``), GELU in its exact and its tanh form."""
    from .lut import FUNCTIONS

    return tuple((fn, a) for fn in FUNCTIONS for a in (("none", "tanh") if fn == "gelu" else ("none",)))


def _probe() -> torch.Tensor:
    return torch.linspace(-32.0, 32.0, 8193, dtype=torch.float32).reshape(1, 1, -1)


def _function_names(module: nn.Module, x: torch.Tensor):
    """``(output, names)``: ``module(x)`` under no_grad, recorded by ``dal.capture``; ``names``: the
    torch functions it called that made a tensor, in order."""
    with torch.no_grad():
        with recording(module, sites=False) as record:
            y = module(x)
    return y, [getattr(c.target, "__name__", str(c.target)) for c in record.functions()]


def candidate(module: nn.Module) -> bool:
    """A module worth probing: a parameter- and buffer-free leaf of a class outside torch and dal."""
    mod = type(module).__module__
    slots = own_slots(module)
    return not mod.startswith(("torch.", "dal.")) and not slots.modules and not slots.parameters and not slots.buffers


def probe_activation(module: nn.Module) -> Optional[tuple[str, str]]:
    """``(fn, approximate)`` when ``module`` computes one LUT activation (module doc), else None.
    The answer is kept per module object."""
    if module in _CACHE:
        return _CACHE[module]
    found = _probe_once(module) if candidate(module) else None
    _CACHE[module] = found
    return found


def _probe_once(module: nn.Module) -> Optional[tuple[str, str]]:
    from .lut import apply_function

    x = _probe()
    try:
        y, names = _function_names(module, x.clone())
    except Exception:  # noqa: BLE001 - a module that does not take one tensor is no activation
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype or not torch.isfinite(y).all():
        return None
    if not names or any(bad in name.lower() for name in names for bad in _NOT_POINTWISE):
        return None
    hits = []
    for fn, approximate in candidates():
        want = apply_function(fn, x, approximate)
        if bool(((y - want).abs() <= TOLERANCE * (1 + want.abs())).all()):
            hits.append((fn, approximate))
    return hits[0] if len(hits) == 1 else None


def function_calls(module: nn.Module) -> list[str]:
    """The torch functions ``module`` calls on the probe that make a tensor, in order (for reports)."""
    return _function_names(module, _probe())[1]



