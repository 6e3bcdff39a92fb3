"""One observer for a shared-scale group: the union of every tensor the group's quantizer sees
during one forward of the group's module, observed as one tensor.

A concat (or add) that does not requantize needs one (scale, zero point) for all its inputs and
its output, so a single quantizer serves them all; but a moving-average or histogram observer
fed the inputs one by one would average ranges of different tensors instead of taking their
union. ``UnionObserver`` holds the tensors of the current forward (``pending``) and feeds their
concatenation to the wrapped observer at ``flush()``, which the group's module calls before
each forward (so every member of one forward uses the same scale during QAT) and, while
calibrating, after it.
"""
from __future__ import annotations

import torch

from .base import Observer


class UnionObserver(Observer):
    """Wraps ``inner``; ``forward`` only records, ``flush`` observes the union once."""

    def __init__(self, inner: Observer):
        super().__init__(inner.fmt, inner.granularity, inner.symmetric, inner.narrow_range,
                         power_of_two=inner.power_of_two, fixed_scale=inner.fixed_scale)
        self.inner = inner
        self.updates_during_training = inner.updates_during_training
        self._pending: list[torch.Tensor] = []

    def __setattr__(self, name, value):
        # the quantizer sets power_of_two on "its observer": the wrapped one must follow
        if name == "power_of_two" and "inner" in self._modules:
            self._modules["inner"].power_of_two = value
        super().__setattr__(name, value)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            raise ValueError(f"UnionObserver got an empty tensor of shape {tuple(x.shape)}")
        self._pending.append(x.detach().reshape(-1))
        return x

    @torch.no_grad()
    def flush(self) -> None:
        """Observe the concatenation of the pending tensors (if any) with the wrapped observer."""
        if self._pending:
            union = torch.cat(self._pending)
            self._pending = []
            self.inner(union)

    @property
    def has_data(self) -> bool:
        return self.inner.has_data or bool(self._pending)

    def calculate_qparams(self):
        if not self.inner.has_data:
            self.flush()  # the very first forward: nothing earlier to use
        return self.inner.calculate_qparams()

    def extra_repr(self) -> str:
        return "union of the group's tensors per forward"
