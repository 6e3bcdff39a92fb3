"""FakeQuantizer: one tensor's format, observer and quantization parameters, as an nn.Module.

States (``quantizer.state``):

* ``observe``  — calibration: the observer sees the tensor, the output is the input unchanged;
* ``quantize`` — QAT: fake quantization with the current (scale, zero_point); a cheap observer
  (min-max) keeps updating them each step, a learnable scale is trained instead;
* ``frozen``   — fake quantization with fixed parameters, observer off (late QAT, export); a
  learnable scale is a Parameter and the optimizer keeps training it in this state too (DDP
  expects a gradient for every Parameter it wrapped): to fix it, leave it out of the optimizer;
* ``off``      — identity; the float model.

The state is a buffer, so ``state_dict`` round-trips it together with scale and zero point.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .formats import PER_TENSOR, Granularity, code_range, fake_quantize, get_format
from .formats.qparams import MIN_SCALE
from .observers import make_observer

STATES = ("observe", "quantize", "frozen", "off")


class FakeQuantizer(nn.Module):
    """Fake-quantize a tensor to ``fmt`` at ``granularity`` with ONNX QuantizeLinear semantics.

    Args:
        fmt: a ``QFormat`` or its name ("int8", "int4", "fp8_e4m3", "fp16", ...).
        granularity: ``PER_TENSOR``, ``per_channel(axis)`` or ``per_group(axis, size)``.
        symmetric: zero point 0 (mid code for unsigned formats) instead of an affine range.
        narrow_range: drop the most negative code of signed integers (int8 -> [-127, 127]).
        observer: an observer name ("minmax", "moving_average", "percentile", "kl", "mse").
        observer_args: keyword arguments for the observer.
        learnable: train the scale (and, for affine formats, the zero point) with LSQ / LSQ+
            gradients once calibration has initialised them.
        name: module path, used in error messages (set by ``prepare_qat``).

    Example:
        >>> fq = FakeQuantizer("int8", observer="minmax")
        >>> _ = fq(torch.randn(8, 16)); fq.set_state("frozen")
        >>> y = fq(torch.randn(8, 16))
    """

    def __init__(self, fmt="int8", granularity: Granularity = PER_TENSOR, symmetric: bool = True,
                 narrow_range: bool = False, observer: str = "minmax", observer_args: Optional[dict] = None,
                 learnable: bool = False, name: str = ""):
        super().__init__()
        self.fmt = get_format(fmt)
        self.granularity = granularity
        self.symmetric = symmetric or self.fmt.is_float8
        self.narrow_range = narrow_range
        self.learnable = learnable
        self.name = name
        self.observer_name = observer
        self.qmin, self.qmax = code_range(self.fmt, narrow_range) if self.fmt.is_scaled else (None, None)
        if self.fmt.is_scaled:
            self.observer = make_observer(observer, self.fmt, granularity, self.symmetric, narrow_range,
                                          **(observer_args or {}))
        else:
            self.observer = None
        self.register_buffer("state_code", torch.tensor(0, dtype=torch.int8))
        # Empty until calibration (per-channel shapes are only known from data).
        if learnable:
            self.scale = nn.Parameter(torch.empty(0))
            self.zero_point = nn.Parameter(torch.empty(0), requires_grad=not self.symmetric)
        else:
            self.register_buffer("scale", torch.empty(0))
            self.register_buffer("zero_point", torch.empty(0, dtype=torch.int32))

    # ---- state -------------------------------------------------------------------------
    @property
    def state(self) -> str:
        return STATES[int(self.state_code)]

    def set_state(self, state: str) -> "FakeQuantizer":
        """Switch state; leaving ``observe`` computes (scale, zero_point) from the observer."""
        if state not in STATES:
            raise ValueError(f"state={state!r} is not one of {STATES}")
        if state in ("quantize", "frozen") and self.fmt.is_scaled and not self.initialized:
            if self.observer is None or not self.observer.has_data:
                raise RuntimeError(
                    f"quantizer {self.name or '<unnamed>'} ({self.fmt.name}) has no scale yet: "
                    "calibrate it (dal.calibrate) before switching to 'quantize' or 'frozen'")
            self.update_qparams()
        elif state in ("quantize", "frozen") and self.prev_state_was_observe and self.fmt.is_scaled:
            if self.observer is not None and self.observer.has_data and not self.learnable:
                self.update_qparams()
        self.state_code.fill_(STATES.index(state))
        return self

    @property
    def prev_state_was_observe(self) -> bool:
        return self.state == "observe"

    @property
    def initialized(self) -> bool:
        return self.scale.numel() > 0

    @torch.no_grad()
    def update_qparams(self) -> None:
        """(scale, zero_point) <- the observer's proposal."""
        scale, zero_point = self.observer.calculate_qparams()
        self._set_qparams(scale.to(self.scale.device), zero_point.to(self.scale.device))

    @torch.no_grad()
    def _set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        if self.learnable:
            self.scale.data = scale.clone().float()
            self.zero_point.data = zero_point.clone().float()
        else:
            if self.scale.shape != scale.shape:
                self.scale = scale.clone().float()
                self.zero_point = zero_point.clone().to(torch.int32)
            else:
                self.scale.copy_(scale)
                self.zero_point.copy_(zero_point)

    def effective_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` as the forward applies them, detached: a learnable (LSQ+)
        float zero point rounded half to even, as an int32 tensor like a calibrated one."""
        zp = self.zero_point.detach()
        if zp.is_floating_point():
            zp = torch.round(zp).to(torch.int32)
        return self.scale.detach(), zp

    @torch.no_grad()
    def project_learned_qparams_(self) -> bool:
        """Put a learnable scale / zero point an optimizer step pushed out of range back in it:
        ``scale >= MIN_SCALE`` (a scale <= 0 divides by zero or flips signs) and, for an affine
        format, ``qmin <= zero_point <= qmax`` (the ONNX zero point is of the format's own type).
        In place, and only when something is out of range: the forward calls it every time, so
        a quantizer called twice in one forward does not bump the Parameters' version counter
        between the calls (autograd saved them). Returns whether anything changed."""
        if not (self.learnable and self.initialized and self.fmt.is_scaled):
            return False
        changed = False
        if bool((~(self.scale >= MIN_SCALE)).any()):  # also true for NaN
            if not bool(torch.isfinite(self.scale).all()):
                raise ValueError(f"quantizer {self.name or '<unnamed>'}: the learned scale is not finite "
                                 f"({self.scale.detach().flatten()[:4].tolist()}...): the training diverged; "
                                 "lower the learning rate of the scales or restore a checkpoint")
            self.scale.clamp_(min=MIN_SCALE)
            changed = True
        zp = self.zero_point
        if zp.requires_grad and zp.numel() and bool((~((zp >= self.qmin) & (zp <= self.qmax))).any()):
            if not bool(torch.isfinite(zp).all()):
                raise ValueError(f"quantizer {self.name or '<unnamed>'}: the learned zero point is not finite")
            zp.clamp_(self.qmin, self.qmax)
            changed = True
        return changed

    # ---- forward -----------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = int(self.state_code)
        if code == 3:  # off
            return x
        if code == 0:  # observe: the output is the input unchanged, for every format
            if self.observer is not None:
                self.observer(x)
            return x
        if not self.fmt.is_scaled:
            return fake_quantize(x, self.fmt, check=False)
        if code == 1 and not self.learnable and self.observer.updates_during_training and self.training:
            self.observer(x)
            self.update_qparams()
        if not self.initialized:
            raise RuntimeError(f"quantizer {self.name or '<unnamed>'} has no scale: calibrate first")
        scale, zero_point, grad_scale = self.scale, self.zero_point, 1.0
        if self.learnable:
            self.project_learned_qparams_()
            # LSQ: g = 1 / sqrt(N_per_scale * qmax) keeps the scale's step size comparable to the weights'.
            per_scale = max(x.numel() // max(self.scale.numel(), 1), 1)
            grad_scale = 1.0 / math.sqrt(per_scale * max(abs(self.qmax), 1.0))
        return fake_quantize(x, self.fmt, scale, zero_point, self.granularity, self.narrow_range,
                             learnable=self.learnable, grad_scale=grad_scale, check=False)

    # ---- persistence -------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Scale and zero point are sized by calibration; a fresh quantizer adopts the checkpoint's shapes.
        for name in ("scale", "zero_point"):
            key = prefix + name
            if key in state_dict:
                value = state_dict[key]
                current = getattr(self, name)
                if current.shape != value.shape:
                    if isinstance(current, nn.Parameter):
                        current.data = torch.empty_like(value, dtype=current.dtype)
                    else:
                        setattr(self, name, torch.empty_like(value, dtype=current.dtype))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        parts = [self.fmt.name, str(self.granularity)]
        if self.fmt.is_scaled:
            parts.append("symmetric" if self.symmetric else "affine")
            if self.narrow_range:
                parts.append("narrow")
            parts.append(f"observer={self.observer_name}")
        if self.learnable:
            parts.append("learnable")
        parts.append(f"state={self.state}")
        if self.initialized:
            s = self.scale.detach().flatten()
            parts.append(f"scale={float(s[0]):.4g}" if s.numel() == 1 else
                         f"scale=[{s.numel()} values {float(s.min()):.3g}..{float(s.max()):.3g}]")
        return ", ".join(parts)
