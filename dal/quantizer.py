"""FakeQuantizer: one tensor's format, observer and quantization parameters, as an nn.Module.

States (``quantizer.state``, a :class:`QState`, equal to its name: ``q.state == "frozen"``):

* ``observe``  — calibration: the observer sees the tensor, the output is the input unchanged;
* ``quantize`` — QAT: fake quantization with the current (scale, zero_point); a cheap observer
  (min-max) keeps updating them each training step, a learnable scale is trained instead;
* ``frozen``   — fake quantization with fixed parameters, observer off (late QAT, export); a
  learnable scale is a Parameter and the optimizer keeps training it in this state too (DDP
  expects a gradient for every Parameter it wrapped): to fix it, leave it out of the optimizer;
* ``off``      — identity; the float model.

Everything that changes a quantizer's state or parameters is a method of this file:
``set_state`` only sets the state; ``compute_qparams`` takes (scale, zero_point) from the
observer; ``end_observation`` is the calibration transition (compute, then set);
``set_qparams`` / ``clear_qparams`` / ``snapshot`` / ``restore`` serve the searches that try
scales and put them back; :func:`quantizer_states` switches a whole model for a ``with`` block.

The state is a buffer (``state_code``): ``state_dict`` round-trips it with scale and zero point; the
forward reads a Python mirror of it, chosen once per state change (``use_kernel``).
Under ``torch.compile``, and for bf16 / fp16 input, it is ``dal.quantizer_ops.ops_forward`` (dal.kernels' ops,
LSQ included).
"""
from __future__ import annotations

import contextlib
import copy
import enum
from typing import Iterator, Optional

import torch
from torch import nn

from .formats import PER_TENSOR, Granularity, code_range, fake_quantize, get_format
from .formats.autograd import pow2_scale_ste
from .formats.fold import FoldedFakeQuantizeFunction, fold_eligible, fold_granularity, kernel_format, scale_extremes
from .formats.track import fixed_kernel_params, fold_track_forward, kernel_fake_quantize, track_qparams
from .formats.qparams import MIN_SCALE, check_pow2_rounding, power_of_two_scale
from .observers import MinMaxObserver, make_observer
from .kernels.lsq import fake_quantize_lsq, lsq_grad_scale
from .quantizer_ops import ops_forward


class QState(str, enum.Enum):
    """A quantizer's state; a ``str`` so that ``q.state == "frozen"`` reads naturally."""

    OBSERVE = "observe"
    QUANTIZE = "quantize"
    FROZEN = "frozen"
    OFF = "off"

    @property
    def code(self) -> int:
        """The integer stored in the ``state_code`` buffer (checkpoints keep these numbers)."""
        return _CODES[self]

    @property
    def quantizes(self) -> bool:
        """True for the states that fake-quantize (``quantize`` and ``frozen``)."""
        return self in (QState.QUANTIZE, QState.FROZEN)

    @classmethod
    def of(cls, state) -> "QState":
        """``state`` (a QState or its name) as a QState; a bad name raises ``ValueError``."""
        try:
            return cls(state)
        except ValueError:
            raise ValueError(f"state={state!r} is not one of {STATES}") from None

    def __str__(self) -> str:
        return self.value


STATES = tuple(s.value for s in QState)
_HALF = (torch.bfloat16, torch.float16)  # inputs (autocast) that take dal.kernels' ops eagerly too
_CODES = {s: i for i, s in enumerate(QState)}
_BY_CODE = tuple(QState)


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

    Example: ``fq = FakeQuantizer("int8"); fq(x_calib); fq.end_observation("frozen"); y = fq(x)``.
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
        #: "nearest" / "cover" when every scale must be 2^k (``constrain_power_of_two``), else None
        self.power_of_two = None
        if getattr(self.observer, "power_of_two", None) is not None:
            self.constrain_power_of_two(self.observer.power_of_two)
        self._mirror(QState.OBSERVE)

    # ---- state -------------------------------------------------------------------------
    state = property(lambda self: self._state, doc="The state, a QState (set it with set_state).")

    def set_state(self, state) -> "FakeQuantizer":
        """Set the state, and only that: scale and zero point are untouched. A scaled format needs them set for
        ``quantize`` / ``frozen`` (``compute_qparams``, ``end_observation``, ``dal.calibrate``), else it raises."""
        state = QState.of(state)
        if state.quantizes and self.fmt.is_scaled and not self.initialized:
            raise RuntimeError(f"quantizer {self.name or '<unnamed>'} ({self.fmt.name}) has no scale yet: calibrate it "
                               f"(dal.calibrate, or end_observation once observed) before switching to {state.value!r}")
        self._write_state(state)
        return self

    def end_observation(self, state="quantize") -> "FakeQuantizer":
        """The calibration transition: leave ``observe`` for ``state``, first taking (scale, zero_point) from the
        observer if it saw data (an initialised learnable scale keeps what it learned). Else ``set_state``."""
        if self._state is QState.OBSERVE and self.fmt.is_scaled and self.observer is not None \
                and self.observer.has_data and not (self.learnable and self.initialized):
            self.compute_qparams()
        return self.set_state(state)

    initialized = property(lambda self: self.scale.numel() > 0, doc="Calibrated: scale and zero point are set.")

    def _write_state(self, state: QState) -> None:
        self.state_code.fill_(state.code)
        self._mirror(state)

    def _mirror(self, state: QState) -> None:
        """The forward's view of the state, decided once here instead of on every call."""
        self._state = state
        self.fake_quantizes = state.quantizes and self.fmt.is_scaled
        self.casts = state.quantizes and not self.fmt.is_scaled
        # QAT with a cheap observer (min-max) updates the scale each step; the observer can change
        # (calibration swaps them): read per call (tracking). Then the C++ kernel path: straight-through
        # estimator, integer and FP8 formats, unless use_kernel(False).
        self._tracks_range = state is QState.QUANTIZE and self.fmt.is_scaled and not self.learnable
        self._kernel = self.fake_quantizes and not self.learnable and kernel_format(self.fmt) \
            and self.__dict__.get("_use_kernel", True)
        # under torch.compile: dal.kernels' ops (dal.quantizer_ops); a learnable scale: dal::fake_quantize_lsq
        self._ops = self.fake_quantizes or self.casts or state is QState.OBSERVE

    def use_kernel(self, enabled: bool = True) -> "FakeQuantizer":
        """False: every call takes the torch path (observer, set_qparams, fake_quantize), the fast paths' reference."""
        self._use_kernel = bool(enabled)
        self._mirror(self._state)
        return self

    # ---- parameters --------------------------------------------------------------------
    @torch.no_grad()
    def constrain_power_of_two(self, rounding: str = "cover") -> "FakeQuantizer":
        """From now on every scale is exactly ``2^k`` (``rounding``: "nearest" in the log domain or
        "cover", see ``dal.formats.qparams.POW2_ROUNDINGS``): the observer proposes such scales and
        ``set_qparams`` rounds any other. A learnable scale becomes LSQ on ``log2_scale`` (a
        Parameter; ``scale`` turns into a buffer holding ``2^round(log2_scale)`` as last applied),
        so call this before the optimizer is built, as ``prepare_qat`` does."""
        self.power_of_two = check_pow2_rounding(rounding)
        if self.observer is not None:
            self.observer.power_of_two = rounding
        if self.learnable and "log2_scale" not in self._parameters:
            scale = self.scale.detach().clone()
            del self._parameters["scale"]
            self.register_buffer("scale", scale)
            self.log2_scale = nn.Parameter(torch.log2(scale) if scale.numel() else torch.empty(0))
        if self.initialized:
            self.set_qparams(*self.effective_qparams())
        return self

    @torch.no_grad()
    def compute_qparams(self) -> None:
        """(scale, zero_point) <- the observer's proposal (``observer.calculate_qparams()``)."""
        if self.observer is None or not self.observer.has_data:
            raise RuntimeError(f"quantizer {self.name or '<unnamed>'} ({self.fmt.name}): its observer has seen "
                               "no data; run calibration data through the model first")
        scale, zero_point = self.observer.calculate_qparams()
        self.set_qparams(scale.to(self.scale.device), zero_point.to(self.scale.device))

    @torch.no_grad()
    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        """Make ``(scale, zero_point)`` this quantizer's (copies; a new shape is adopted). Under
        ``power_of_two`` the scale is rounded to ``2^k`` first and an integer affine zero point
        moved so that the range's low end ``(qmin - zp) * s`` stays put."""
        if self.power_of_two is not None and self.fmt.is_scaled:
            scale, zero_point = self._pow2_qparams(scale, zero_point)
            if self.learnable:
                self.log2_scale.data = torch.log2(scale.double()).float()
                self.scale = scale.clone().float()
                self.zero_point.data = zero_point.clone().float()
                return
        if self.learnable:
            self.scale.data = scale.clone().float()
            self.zero_point.data = zero_point.clone().float()
        elif self.scale.shape != scale.shape:
            self.scale = scale.clone().float()
            self.zero_point = zero_point.clone().to(torch.int32)
        else:
            self.scale.copy_(scale)
            self.zero_point.copy_(zero_point)

    def _pow2_qparams(self, scale, zero_point):
        scale = scale.detach().float()
        new = power_of_two_scale(scale, self.power_of_two)
        if self.symmetric or not self.fmt.is_integer or bool((new == scale).all()):
            return new, zero_point
        zp = torch.round(zero_point.double()) if zero_point.is_floating_point() else zero_point.double()
        low = (self.qmin - zp) * scale.double()
        zp = torch.clamp(self.qmin - torch.round(low / new.double()), self.qmin, self.qmax)
        return new, zp.to(zero_point.dtype)

    @torch.no_grad()
    def clear_qparams(self) -> None:
        """Back to the uncalibrated state's empty scale and zero point."""
        if self.learnable and "log2_scale" in self._parameters:
            self.log2_scale.data = torch.empty(0, device=self.scale.device)
            self.scale = torch.empty(0, device=self.scale.device)
            self.zero_point.data = torch.empty(0, device=self.scale.device)
        elif self.learnable:
            self.scale.data = torch.empty(0, device=self.scale.device)
            self.zero_point.data = torch.empty(0, device=self.scale.device)
        else:
            self.scale = torch.empty(0, device=self.scale.device)
            self.zero_point = torch.empty(0, dtype=torch.int32, device=self.scale.device)

    def snapshot(self) -> tuple:
        """Everything a search may change (state, observer, scale, zero point), for ``restore``."""
        return (self._state, copy.deepcopy(self.observer), self.scale.detach().clone(),
                self.zero_point.detach().clone())

    @torch.no_grad()
    def restore(self, snap: tuple) -> None:
        """Put back what ``snapshot`` saw, exactly (no qparams are recomputed)."""
        state, observer, scale, zero_point = snap
        self.observer = copy.deepcopy(observer)
        if scale.numel():
            self.set_qparams(scale, zero_point)
        else:
            self.clear_qparams()
        self._write_state(state)

    def effective_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, zero_point)`` as the forward applies them, detached: a learnable (LSQ+)
        float zero point rounded half to even, as an int32 tensor like a calibrated one."""
        zp = self.zero_point.detach()
        if zp.is_floating_point():
            zp = torch.round(zp).to(torch.int32)
        return self.scale.detach(), zp

    @torch.no_grad()
    def project_learned_qparams_(self) -> bool:
        """Put a learnable scale / zero point an optimizer step pushed out of range back in it: ``scale >=
        MIN_SCALE`` (a scale <= 0 divides by zero or flips signs) and, affine, ``qmin <= zero_point <= qmax``
        (ONNX's zero point has the format's type). In place, only when out of range: the forward calls it
        every time, and a second call in one forward must not bump the counters autograd saved. Returns
        whether it changed anything."""
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
        # One branch per state, chosen at the state change (_mirror); per call only what depends on the tensor.
        if self._ops and (torch.compiler.is_compiling() or x.dtype in _HALF):  # ops: scales, rounding in float32
            return ops_forward(self, x)
        if self._kernel:
            y = self._kernel_forward(x)
            if y is not None:
                return y
        if self.fake_quantizes:
            scale, zero_point = self.scale, self.zero_point
            if self.tracking():
                self.observer(x)
                self.compute_qparams()
                # A module called several times in one forward (a detection head per pyramid level) has
                # ONE set of statistics, as the deployed head has one scale. compute_qparams writes the
                # buffers in place, so this call gets copies: autograd saved them for the backward.
                scale, zero_point = self.scale.clone(), self.zero_point.clone()
            elif not self.initialized:
                raise RuntimeError(f"quantizer {self.name or '<unnamed>'} has no scale: calibrate first")
            if self.learnable:
                return self._learnable_forward(x)
            return fake_quantize(x, self.fmt, scale, zero_point, self.granularity, self.narrow_range,
                                 check=False)
        if self.casts:
            return fake_quantize(x, self.fmt, check=False)
        if self._state is QState.OBSERVE and self.observer is not None:
            self.observer(x)
        return x  # observe and off: the output is the input unchanged

    def _kernel_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """This call by the C++ kernel, the observer's QAT step included (``dal.formats.track``), or
        None: the torch path decides (it also raises for a quantizer without a scale)."""
        step = self._track_step() if self.tracking() else False  # None: tracking, not by the kernel
        if step is None:
            return None
        return kernel_fake_quantize(x, self.granularity, self.fmt, self.qmin, self.qmax, self.scale, self.zero_point,
                                    step or None)

    def _kernel_params(self, x: torch.Tensor, f: Optional[torch.Tensor]) -> Optional[tuple]:
        """This call's ``(s, lo, hi, mode)`` for the C++ kernel, after the observer's QAT step (of
        ``x``, or ``x * f``) in one C++ call (``dal.formats.track``: the torch path's numbers).
        None: the torch path decides (it also raises for a quantizer without a scale)."""
        if not self.tracking():
            return fixed_kernel_params(self.scale, self.zero_point, self.fmt, self.qmin, self.qmax) \
                if self.initialized else None
        step = self._track_step()
        rows = scale_extremes(x, self.granularity, f) if step else None
        return None if rows is None else track_qparams(*rows, *step, self.scale, self.zero_point)

    def tracking(self) -> bool:
        """Whether this call's QAT step updates the scale (a cheap observer, in training)."""
        return self._tracks_range and self.training and self.observer.updates_during_training

    def _track_step(self) -> Optional[tuple]:  # the observer's track_step() if it is ours (not for 2^k scales)
        o, mine = self.observer, (self.fmt, self.symmetric, self.narrow_range)
        same = isinstance(o, MinMaxObserver) and (o.fmt, o.symmetric, o.narrow_range) == mine
        return o.track_step() if same and self.power_of_two is None else None

    def fold_quantize(self, weight: torch.Tensor, f: torch.Tensor, divide: bool) -> Optional[torch.Tensor]:
        """``self(weight * f[:, None, ...])`` (``/ f`` again when ``divide``) in one pass over the
        weight (``dal.formats.fold``): the bits of the ops one by one, forward and ``d/d weight``.
        None where that path does not apply: the caller runs the ops one by one."""
        if not (self._kernel and fold_granularity(self.granularity) and fold_eligible(weight, f)):
            return None
        done = None
        if self.granularity.axis is not None and self.tracking():  # per channel: W read once (track.py)
            step, grad = self._track_step(), weight.requires_grad or f.requires_grad
            done = step and fold_track_forward(weight, f, *step, self.scale, self.zero_point, divide, grad)
            if not done:
                return None
        kp = done[2] if done else self._kernel_params(weight, f)
        return None if kp is None else FoldedFakeQuantizeFunction.apply(
            weight, f, self.scale, self.zero_point, self.fmt, self.qmin, self.qmax, divide, kp,
            done[:2] if done else None)

    def _learnable_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.project_learned_qparams_()
        grad_scale = lsq_grad_scale(x.numel(), self.scale.numel(), self.qmax)  # LSQ's g = 1 / sqrt(N * qmax)
        scale = self.scale
        if self.power_of_two is not None:
            if not bool(torch.isfinite(self.log2_scale).all()):
                raise ValueError(f"quantizer {self.name or '<unnamed>'}: the learned log2 scale is not finite: "
                                 "the training diverged; lower the learning rate of the scales")
            scale = pow2_scale_ste(self.log2_scale, self.power_of_two)
            with torch.no_grad():
                self.scale.copy_(scale)  # what export and the integer model read: exactly 2^k
        # dal::fake_quantize_lsq (on the CPU its C++ kernels), as under torch.compile (quantizer_ops.ops_learnable)
        return fake_quantize_lsq(x, scale, self.zero_point, self.fmt, self.granularity, self.narrow_range, grad_scale)

    # ---- persistence -------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Scale and zero point are sized by calibration; a fresh quantizer adopts the checkpoint's shapes.
        for name in ("scale", "zero_point", "log2_scale"):
            key = prefix + name
            if hasattr(self, name) and key in state_dict:
                value, current = state_dict[key], getattr(self, name)
                if current.shape != value.shape:
                    if isinstance(current, nn.Parameter):
                        current.data = torch.empty_like(value, dtype=current.dtype)
                    else:
                        setattr(self, name, torch.empty_like(value, dtype=current.dtype))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        self._mirror(_BY_CODE[int(self.state_code)])

    def extra_repr(self) -> str:
        parts = [self.fmt.name, str(self.granularity)]
        if self.fmt.is_scaled:
            parts.append("symmetric" if self.symmetric else "affine")
            if self.narrow_range:
                parts.append("narrow")
            parts.append(f"observer={self.observer_name}")
        if self.learnable:
            parts.append("learnable")
        parts.append(f"state={self.state.value}")
        if self.initialized:
            s = self.scale.detach().flatten()
            parts.append(f"scale={float(s[0]):.4g}" if s.numel() == 1 else
                         f"scale=[{s.numel()} values {float(s.min()):.3g}..{float(s.max()):.3g}]")
        return ", ".join(parts)


def quantizers(model: nn.Module) -> Iterator[tuple[str, FakeQuantizer]]:
    """``(path, quantizer)`` of every FakeQuantizer in ``model`` (itself included), in module order."""
    for name, mod in model.named_modules():
        if isinstance(mod, FakeQuantizer):
            yield name, mod


@contextlib.contextmanager
def quantizer_states(model: nn.Module, state=None) -> Iterator[list[FakeQuantizer]]:
    """``with quantizer_states(model, "off"):`` — every quantizer of ``model`` in ``state`` for the
    block (None: unchanged), and each one's own state, exactly, back on exit (also on an
    exception; no scale is recomputed). Yields the quantizers.

    >>> with dal.quantizer_states(model, "off"):
    ...     float_out = model(x)        # the float model, whatever the states were
    """
    qs = [q for _, q in quantizers(model)]
    saved = [(q, q.state) for q in qs]
    try:
        if state is not None:
            target = QState.of(state)
            for q in qs:
                # "off" and "observe" need no scale; a quantizing state is refused by set_state.
                q.set_state(target)
        yield qs
    finally:
        for q, s in saved:
            q._write_state(s)
