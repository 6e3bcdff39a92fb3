"""A QAT quantizer's per-tensor tracking call bound once to its observer and buffers.

``FakeQuantizer._kernel_forward`` decides per call, through ``_tracking``, ``_track_step``,
the observer's ``track_step`` and ``track.kernel_fake_quantize``, whether its call is the C++
observer step + fake quantization of one tensor. Inside a training step that chain is the
main cost of a small quantizer call (``dal.formats.track_call`` says why and how much). Once it
has taken that route, the quantizer keeps a ``BoundCall``: the observer object, the
configuration the route depended on, and a ``formats.track_call.TrackCall`` over the same
buffers. At each call :meth:`BoundCall.holds` re-checks, by identity, everything that the chain
reads and that code can change between two calls:

* the observer is the same object (calibration methods swap observers), of the same type
  (an identity check covers it), and still holds the same ``min_val`` / ``max_val`` /
  ``batches_seen`` buffer objects (``.to()``, ``load_state_dict(assign=True)`` replace them);
* the quantizer still holds the same ``scale`` / ``zero_point`` objects, format, symmetry,
  range, granularity and power-of-two setting, and so does the observer (with its fixed scale
  and moving-average constant);
* one process (several all-reduce their ranges: the torch path);
* training mode (the state is the quantizer's own: any state change drops the binding).

Whatever fails falls back to the full chain, which decides and may bind again. The bits are the
same either way (tests/test_quantizer_bound.py compares steps with and without).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import quantizer_sole_input as sole_input
from .formats.track_call import TrackCall
from .observers.distributed import world_size


class BoundCall:
    """A quantizer's ``TrackCall`` with the configuration it was bound under (module doc)."""

    __slots__ = ("observer", "fmt", "symmetric", "narrow_range", "granularity", "ema", "call")

    def __init__(self, quantizer, step: tuple):
        self.observer = quantizer._modules["observer"]
        self.fmt, self.symmetric, self.narrow_range = quantizer.fmt, quantizer.symmetric, quantizer.narrow_range
        self.granularity, self.ema = quantizer.granularity, step[3]
        self.call = TrackCall(*step, quantizer.scale, quantizer.zero_point)

    @classmethod
    def of(cls, quantizer, step: Optional[tuple]) -> Optional["BoundCall"]:
        """A binding for ``quantizer`` after its chain took the per-tensor C++ route with
        ``step`` (its ``_track_step()``), or None where that route does not apply."""
        if step is None or quantizer.granularity.axis is not None or quantizer.scale.numel() != 1:
            return None
        b = cls(quantizer, step)
        return b if b.holds(quantizer) and b.call.tensors_ok() else None

    def run(self, q, x: torch.Tensor, stats) -> Optional[torch.Tensor]:
        """The bound call on ``x``: written into ``x`` where ``x`` was offered to ``q`` (it is the
        only reader: ``dal.quantizer_sole_input``), else into a new tensor; None where the full
        chain must decide."""
        y = self.call.in_place(x) if sole_input.take(q, x) else None
        return y if y is not None else self.call(x, stats)

    def holds(self, q) -> bool:
        """Whether ``q`` still has everything this binding was made under (module doc)."""
        o = q._modules.get("observer")
        if o is not self.observer:
            return False
        ob, qb, qd, od = o._buffers, q._buffers, q.__dict__, o.__dict__
        mn, mx, bs, s, zp = self.call.tensors
        fmt = self.fmt
        return (ob.get("min_val") is mn and ob.get("max_val") is mx and ob.get("batches_seen") is bs
                and qb.get("scale") is s and qb.get("zero_point") is zp and qd["fmt"] is fmt
                and (od["fmt"] is fmt or od["fmt"] == fmt)  # a deep-copied observer has an equal copy
                and qd["symmetric"] == self.symmetric == od["symmetric"]
                and qd["narrow_range"] == self.narrow_range == od["narrow_range"]
                and qd["granularity"] is self.granularity and od.get("averaging_constant") == self.ema
                and qd["power_of_two"] is None and od["power_of_two"] is None and od["fixed_scale"] is None
                and "updates_during_training" not in od and world_size() == 1)
