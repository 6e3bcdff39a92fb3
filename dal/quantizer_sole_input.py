"""The one tensor a quantizer may fake-quantize in place, offered by the caller that proved it.

A QAT input quantizer writes a new tensor: its input may have other readers. Where a caller
has proven that the quantizer is the input's only reader (``dal.nn.sole_input``: a Sequential's
loop, on the tensor its previous child returned), it *offers* that tensor to that quantizer for
the next call; the quantizer *takes* it when the very same tensor object arrives, and may then
write the fake quantization into it (``formats.track_call.TrackCall.in_place``: the same bits,
one full-size tensor fewer). The offer is per thread and holds the tensor weakly; a loop
withdraws it when the call returns, a GraphModule's offer (``dal.nn.sole_input.offer_output``)
stays until it is taken or replaced: it matches only that quantizer called with that very
tensor, which the graph passes to that one reader only.
"""
from __future__ import annotations

import threading
import weakref

import torch

_LOCAL = threading.local()


def offer(quantizer, x: torch.Tensor) -> None:
    """Let ``quantizer`` overwrite ``x`` at its next call with ``x`` (the caller proved no other reader)."""
    _LOCAL.offer = (quantizer, weakref.ref(x))  # weak: an offer never taken keeps nothing alive


def withdraw() -> None:
    """End the current offer (the call it was made for has returned)."""
    _LOCAL.offer = None


def take(quantizer, x: torch.Tensor) -> bool:
    """Whether ``x`` is the tensor offered to ``quantizer``; the offer is used up either way it matches."""
    o = getattr(_LOCAL, "offer", None)
    if o is None or o[0] is not quantizer or o[1]() is not x:
        return False
    _LOCAL.offer = None
    return True
