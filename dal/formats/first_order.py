"""``first_order``: ``torch.autograd.function.once_differentiable`` without its cost where it
does nothing.

dal's fused kernels have hand-written backwards that are not themselves differentiable, so
each is marked once-differentiable: under ``create_graph=True`` a second backward must raise,
not silently give zero. torch's decorator runs every backward inside ``torch.no_grad()`` and
then returns at once when grad mode is off, which it is in every ordinary ``loss.backward()``
(autograd turns it on only for ``create_graph=True``). A QAT step of a detector runs ~360 such
backwards; the context manager is ~6 Python calls each, in a phase where the interpreter's code
is out of the caches. This decorator checks grad mode first and takes torch's wrapper only
when it is on, so the behaviour is torch's in both cases.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch


def first_order(backward: Callable) -> Callable:
    """Decorate a ``torch.autograd.Function.backward`` like ``once_differentiable`` (module doc)."""
    guarded = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: torch's no_grad + DelayedError node
            return guarded(ctx, *grads)
        return backward(ctx, *grads)
    return run
