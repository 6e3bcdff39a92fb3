"""A FakeQuantizer's forward under ``torch.compile`` (and for bfloat16 / float16 input, as under
autocast: scales and rounding in float32, output in the input's dtype): the registered ops of
``dal.kernels`` (under ``torch.compile`` a calibrating observer's update in its plain-torch form, see below).

No ``.item()``, no ctypes call, no Python branch on a tensor's value, so dynamo traces it without
a graph break, and each op runs the same code compiled or not:

* observing in QAT (``quantize``, training, a min-max observer): ``dal::observe_fake_quantize_``, the
  observer's update, the scale and zero point (written into ``scale`` / ``zero_point``) and the fake
  quantization in one op (:func:`ops_observe_fake_quantize`; with ``COMPILED_FORM["observe"]`` not
  "fused": ``dal::observe_minmax_`` -> ``dal::minmax_qparams`` -> ``dal::fake_quantize``, the same bits);
* ``frozen`` (or ``quantize`` in eval): ``dal::fake_quantize`` with the stored parameters;
* a learnable scale (LSQ / LSQ+, ``quantize`` or ``frozen``): ``dal::fake_quantize_lsq`` (:func:`ops_learnable`);
* FP16 / BF16: ``dal::fp_round_trip``;  ``observe`` (calibration): ``dal::observe_minmax_``.

Which form per op under ``torch.compile`` (:data:`COMPILED_FORM`). Both forms give the same bits,
so the faster compiled step decides; the measurements are in bench/results/qat_step.md,
"compiled: which form per op":

* fake quantization and its STE backward: the opaque ``dal::fake_quantize`` / ``dal::mask_grad``.
  Its C++ kernel is one vectorized pass writing a bit-packed mask; the inlined plain-torch form
  (:class:`dal.kernels.fake_quant_inline.FakeQuantizeInline`), which inductor fuses with the
  BatchNorm / ReLU / add around it, writes a byte mask that its backward reads back, and the
  step is slower. The inlined form stays as the measured alternative for devices where inductor's
  fused kernel may win (it is the op's device-generic formula);
* the observing QAT step: one op, ``dal::observe_fake_quantize_`` ("fused"): its CPU kernel is the
  eager C++ step (one range pass, the scale in C++, one fake-quantization pass) and it replaces an
  inlined observer reduction, ~30 small float64 tensor ops of the scale and their copies per
  quantizer, and the compiled step is faster (bench/results/qat_step.md, "one op per quantizer
  step"). Calibration (``observe``) keeps the inlined plain-torch update
  (``dal.kernels.observer_update.generic``), no slower than the op;
* the FP16 / BF16 round trip: the opaque ``dal::fp_round_trip``, never plain torch: inductor
  (``emulate_precision_casts`` off, its default) drops a plain-torch ``x.to(float16).to(float32)``
  inside a fused kernel, so the island's rounding would vanish (tests/kernels/test_compile.py,
  bench/results/llm_qat.md "tried and not kept"). On the tiny Llama's W4A8 step the inlined
  fake quantization with the inlined observer is also slower than the ops, and a plain-torch
  straight-through backward of the observing op gains under the 5% a new form must buy (same file);
* the scale (``dal::minmax_qparams``, inside the fused op or alone) and QConvBn2d's fold factor
  (``dal::fold_factor``) stay ops for their bits: inductor recompiles the float64 scale arithmetic with its own flags, and would
  recompute a plain-torch fold factor from the running variance BatchNorm already updated
  (pytorch/pytorch#197039).

The same bits as the eager forward (tests/kernels/test_compile.py, test_fake_quant_inline.py).
Eagerly the C++ paths of ``dal.formats`` stay, which fuse the observer's step with the fake
quantization in one pass.
Observers the ops do not cover (histogram, percentile, a fixed scale, several processes that
all-reduce, buffers not created yet) run their own code here too, with graph breaks.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import kernels
from .kernels import observer_update
from .kernels.fake_quant_inline import fake_quantize_inline
from .kernels.observe_fake_quant import observe_fake_quantize
from .formats.autograd import pow2_scale_ste
from .observers.distributed import world_size
from .observers.minmax import MinMaxObserver, MovingAverageMinMaxObserver

#: The form of each step under ``torch.compile`` ("inline": plain torch that inductor fuses; "op": the
#: opaque registered op; "fused", the observing QAT step: dal::observe_fake_quantize_). See the module
#: docstring for the measurement behind each choice.
COMPILED_FORM = {"fake_quantize": "op", "observe": "fused"}


def ops_forward(q, x: torch.Tensor) -> torch.Tensor:
    """``q(x)`` for a FakeQuantizer ``q`` whose state has ops (``q._ops``, decided at its state change)."""
    if q.fake_quantizes:
        scale, zero_point = q.scale, q.zero_point
        if q.tracking():
            if COMPILED_FORM["observe"] == "fused" and not q.learnable and _ops_cover(q.observer):
                return ops_observe_fake_quantize(q, x)
            scale, zero_point = ops_observe(q, x, True)
        elif not q.initialized:
            raise RuntimeError(f"quantizer {q.name or '<unnamed>'} has no scale: calibrate first")
        if q.learnable:
            return ops_learnable(q, x)
        if COMPILED_FORM["fake_quantize"] == "inline" and torch.compiler.is_compiling():
            return fake_quantize_inline(x, scale, zero_point, q.fmt, q.granularity, q.narrow_range)
        return kernels.fake_quantize(x, scale, zero_point, q.fmt, q.granularity, q.narrow_range)
    if q.casts:
        return kernels.fp_round_trip(x, q.fmt.torch_dtype())
    if q.observer is not None:
        ops_observe(q, x, False)
    return x


def ops_observe(q, x: torch.Tensor, qparams: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The observer's step on ``x`` by ``dal::observe_minmax_`` and, with ``qparams``, this call's
    ``(scale, zero_point)`` by ``dal::minmax_qparams``, also written into ``q``'s buffers: the eager
    ``observer(x); compute_qparams()``. Observers the ops do not cover run their own code."""
    o = q.observer
    if not _ops_cover(o):
        o(x)
        if not qparams:
            return None
        q.compute_qparams()
        return q.scale.clone(), q.zero_point.clone()
    observe = observer_update.generic if COMPILED_FORM["observe"] != "op" and torch.compiler.is_compiling() \
        else kernels.observe_minmax_
    observe(x, o.min_val, o.max_val, o.batches_seen, o.nonfinite_count,
            getattr(o, "averaging_constant", 0.0), q.granularity.normalized_axis(x.dim()),
            q.granularity.block_size)
    if not qparams:
        return None
    scale, zero_point = kernels.minmax_qparams(o.min_val, o.max_val, q.fmt.name, q.symmetric, q.narrow_range,
                                               o.power_of_two)
    with torch.no_grad():
        q.scale.copy_(scale)
        q.zero_point.copy_(zero_point)
    return scale, zero_point


def _ops_cover(o) -> bool:
    """Whether the ops do observer ``o``'s update: a min-max observer on one process, buffers created."""
    return type(o) in (MinMaxObserver, MovingAverageMinMaxObserver) and o.fixed_scale is None \
        and isinstance(getattr(o, "min_val", None), torch.Tensor) and world_size() == 1


def ops_observe_fake_quantize(q, x: torch.Tensor) -> torch.Tensor:
    """``q(x)`` for a quantizer observing in QAT by ``dal::observe_fake_quantize_``: the observer's
    update, the scale and zero point (written into ``q``'s buffers) and the fake quantization in
    one op, the bits of ``ops_observe`` then ``dal::fake_quantize``."""
    o = q.observer
    return observe_fake_quantize(x, o.min_val, o.max_val, o.batches_seen, o.nonfinite_count, q.scale, q.zero_point,
                                 getattr(o, "averaging_constant", 0.0), q.fmt, q.symmetric, q.narrow_range,
                                 o.power_of_two, q.granularity.normalized_axis(x.dim()), q.granularity.block_size)


def ops_learnable(q, x: torch.Tensor) -> torch.Tensor:
    """``q(x)`` for a learnable ``q`` by ``dal::fake_quantize_lsq``: the eager ``_learnable_forward``'s
    output and gradients (LSQ's ``g = 1 / sqrt(N * qmax)``; power-of-two scales by
    ``pow2_scale_ste`` of ``log2_scale``, written into ``q.scale``). Eagerly (bf16 / fp16 input) the
    Parameters are first projected in place and checked finite as there; under ``torch.compile``
    the op projects them without writing them (no host read of their values: ``dal.kernels.lsq``)."""
    if not torch.compiler.is_compiling():
        q.project_learned_qparams_()
    scale = q.scale
    if q.power_of_two is not None:
        scale = pow2_scale_ste(q.log2_scale, q.power_of_two)
        with torch.no_grad():
            q.scale.copy_(scale)
    g = kernels.lsq_grad_scale(x.numel(), q.scale.numel(), q.qmax)
    return kernels.fake_quantize_lsq(x, scale, q.zero_point, q.fmt, q.granularity, q.narrow_range, g)
