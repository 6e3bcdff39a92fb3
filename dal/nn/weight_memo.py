"""A weight fake-quantized once per forward of the module that calls its layer several times.

A detection head is one module called once per pyramid level (torchvision's FCOS and
RetinaNet heads loop over five levels inside one forward): each of its convs fake-quantized
the same weight five times per step, forward and backward, for one tensor's worth of numbers
(on fcos_resnet50_fpn about 50 ms of a 0.9 s CPU train step). Inside :func:`weight_scope` (``dal.prepare.call_sites`` opens
one around each forward it routes), :func:`quantized_once` computes a module's quantized
Parameter on the first call and hands the same tensor to the later calls.

That is the same numbers, bit for bit, when a second call of the weight's quantizer on the
same tensor would give the same output and leave the same statistics
(:func:`repeatable`): no quantizer, ``off`` or ``frozen``, or ``quantize`` where the observer
does not move in this call (eval, an observer that does not update during training, no
observer) or keeps the running min / max, which the same tensor leaves as they are. The
backward is then one straight-through mask of the summed gradient instead of the sum of five
masked ones: the mask is 0 or 1, so the sum is the same. Refused (computed every call): a
learnable scale (its gradient is a sum over elements whose order would change), a moving
average observer (each call moves it), calibration (``observe``: some observers count
repeats), any tensor that is not a Parameter (a computed weight is a new tensor each
call), and tracing or compiling (the exported graph keeps one weight quantizer per call, as
written). The key holds the tensor's version counter and the grad mode, so an in-place update
between calls, or a call under ``no_grad``, is computed afresh.

A repeated call still counts in the observer's ``batches_seen``, so the state matches too.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from ..observers import MinMaxObserver
from ..quantizer import FakeQuantizer

_LOCAL = threading.local()  # DataParallel runs replicas in threads: one scope stack per thread


def _stack() -> list:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


@contextlib.contextmanager
def weight_scope() -> Iterator[dict]:
    """Inside the block, :func:`quantized_once` computes each (module, Parameter) once; a scope
    opened inside another shares the outer one's results. Nothing is kept after the outermost
    block ends (autograd keeps what the backward needs)."""
    stack = _stack()
    stack.append(stack[-1] if stack else {})
    try:
        yield stack[-1]
    finally:
        stack.pop()


def enter_scope() -> None:
    """:func:`weight_scope` for a forward pre-hook; pair each call with :func:`exit_scope`."""
    stack = _stack()
    stack.append(stack[-1] if stack else {})


def exit_scope() -> None:
    """End the scope :func:`enter_scope` opened (a forward hook with ``always_call=True``)."""
    stack = _stack()
    if stack:
        stack.pop()


def repeatable(quant: Optional[FakeQuantizer]) -> bool:
    """Whether calling ``quant`` twice on one tensor gives the same output and statistics as
    calling it once (module docstring)."""
    if quant is None:
        return True
    if not isinstance(quant, FakeQuantizer) or quant.learnable:
        return False
    if quant.state in ("off", "frozen"):
        return True
    if quant.state != "quantize":
        return False
    obs = quant.observer
    if obs is None or not quant.training or not obs.updates_during_training:
        return True
    return type(obs) is MinMaxObserver


def _tracing() -> bool:
    """Export and compilation record the graph as written: one weight quantizer per call."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


def _count_call(quant: Optional[FakeQuantizer]) -> None:
    """The observer counts the repeated call as it would have (``batches_seen``, which only
    says whether it has seen data), so the whole state matches the uncached run."""
    obs = getattr(quant, "observer", None)
    if obs is not None and quant.state == "quantize" and quant.training and obs.updates_during_training:
        with torch.no_grad():
            obs.batches_seen.add_(1)


def quantized_once(module: nn.Module, tensor: Optional[torch.Tensor], quant: Optional[FakeQuantizer],
                   compute: Callable[[torch.Tensor], torch.Tensor]) -> Optional[torch.Tensor]:
    """``compute(tensor)``, or, inside a :func:`weight_scope`, the result of the first such call
    for this ``module`` and Parameter ``tensor`` (same version, same grad mode, same
    ``weight_mask`` version) when ``quant``, the quantizer ``compute`` applies, is
    :func:`repeatable`."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack or not isinstance(tensor, nn.Parameter) or not repeatable(quant) or _tracing():
        return compute(tensor)
    memo = stack[-1]
    mask = getattr(module, "weight_mask", None)  # 2:4 sparsity, applied inside compute
    key = (id(module), id(tensor), tensor._version, torch.is_grad_enabled(),
           -1 if mask is None else mask._version)
    hit = memo.get(key)
    if hit is not None and hit[0] is tensor:
        _count_call(quant)
        return hit[1]
    out = compute(tensor)
    memo[key] = (tensor, out)  # the tensor is held, so its id cannot be reused within the scope
    return out
