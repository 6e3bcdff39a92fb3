"""A QAT layer's training weight, its C++ route bound once (``BoundWeight``).

In QAT a layer's weight is fake-quantized per output channel at every step, the observer's
range moving with it. For QConvBn2d that is ``fq_w(W * f) / f``, ``f = gamma / sqrt(running_var
+ eps)``: two C++ calls forward and two backward (``dal.formats.fold_factor``,
``dal.formats.fold``); for a QConv2d / QLinear, ``fq_w(W)``: a range pass, the observer step and
the fake quantization, three C++ calls (``dal.formats.track.kernel_fake_quantize``). Around
them, per layer and step, the per-layer code decides the route again (the quantizer's and the
kernels' checks, the observer's ``track_step``, the buffer checks), allocates up to eight small
tensors, and records one or two autograd Functions. Inside a step the convolutions between
two layers evict that Python from the caches: on SSDlite320 (70 folded layers) the folded path
cost ~15 ms of the QAT step's CPU time at 64x64 inputs, of which the C++ arithmetic is ~4 ms
(bench/results/detection_speed.md, session 14).

Once a layer has taken that route, it keeps a ``BoundWeight``: the tensors the route read (the
objects and their addresses) and its constants. At each call :meth:`BoundWeight.holds` re-checks
everything the route depended on and code can change between two calls: the layer's weight
(and BN gamma, running variance, eps), and weight quantizer are the same objects, at the same
addresses (``.data =`` and ``.to()`` move them), the weight with the same shape, dtype and
layout, trainable; the quantizer is still in QAT with the C++ kernel and its observer's QAT
step (``quantizer_bound.BoundCall.holds``: same observer and buffers, same format and
configuration, one process), and no forward hook watches it (the per-layer route calls it as a
module); no 2:4 mask; not tracing. Then one C++ call, ``dal_fold_track_forward`` (the
per-channel range, the observer step, the fake quantization and its clip mask;
``dal_fold_factor`` first for a folded layer), and ONE autograd Function whose backward is
``dal_fold_backward`` (then ``dal_fold_factor_backward`` on its d f: on this route f has no
other use); each through the one Python wrapper the per-layer route uses too
(``fold_factor_parts``, ``track.fold_track_forward``, ``fold.fold_backward``,
``fold_factor_grad``). A plain layer's weight is the fold with ``f = 1``: ``w * 1`` is ``w`` and
``(g * m) * 1`` is ``g * m`` exactly, so the same rows, scales, codes, mask and gradient as the
three-call route. The same bits and the same buffer writes, at the
same point of the forward (tests/nn/test_weight_bound.py compares steps with and without).
Whatever fails, or a C++ call that declines (a NaN or a zero extreme: it writes nothing then),
falls back to the per-layer code.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn.modules import module as _torch_module

from ..formats import native
from ..formats.first_order import first_order
from ..formats.fold import fold_backward, fold_granularity
from ..formats.fold_factor import fold_factor_grad, fold_factor_parts, kernel_applies
from ..formats.fused import plain_tensor
from ..formats.track import buffers_ok, fold_track_forward
from ..quantizer_bound import BoundCall

_F32 = torch.float32


def watched(q) -> bool:
    """Whether a forward hook (the quantizer's own or a global one) would see the quantizer's
    call: the per-layer route of a plain layer calls it as a module, which runs hooks; the bound
    route does not call it, and an in-place write (dal.nn.sole_input) would change what it saw."""
    return bool(q._forward_hooks or q._forward_pre_hooks or _torch_module._global_forward_hooks
                or _torch_module._global_forward_pre_hooks)


class BoundWeight:
    """A layer's training-weight route with the tensors and constants it was bound under (module doc)."""

    __slots__ = ("weight", "bn", "gamma", "var", "ones", "quant", "quant_bound", "eps", "step", "pointers", "rows",
                 "row_len")

    @classmethod
    def of(cls, module) -> Optional["BoundWeight"]:
        """A binding for ``module`` (a training QConvBn2d with the 1/f on the weight, or a layer
        without BN), or None where its weight does not take the C++ route with the observer's
        QAT step."""
        q, bn, weight = module._modules.get("weight_quant"), module._modules.get("bn"), module._parameters.get("weight")
        if q is None or weight is None or not q._kernel or not q._tracking() or native.library() is None \
                or getattr(module, "weight_mask", None) is not None or watched(q):
            return None
        gamma = var = None
        if bn is not None:
            gamma, var = bn._parameters.get("weight"), bn._buffers.get("running_var")
            if gamma is None or var is None or not gamma.requires_grad or not kernel_applies(gamma, var):
                return None
        rows = weight.shape[0]
        if not (weight.requires_grad and fold_granularity(q.granularity) and q.granularity.axis is not None
                and weight.dim() >= 2 and (gamma is None or rows == gamma.numel()) and weight.dtype is _F32
                and weight.is_cpu and weight.is_contiguous() and plain_tensor(weight)):
            return None
        step = q._track_step()
        if not step or q.scale.numel() != rows or not buffers_ok(step[0], step[1], step[2], q.scale, q.zero_point):
            return None
        b = cls()
        b.weight, b.bn, b.gamma, b.var, b.quant = weight, bn, gamma, var, q
        b.eps = float(bn.eps) if bn is not None else None
        b.ones = torch.ones(rows) if bn is None else None  # a plain weight is the fold with f = 1
        b.quant_bound = BoundCall(q, step)  # for its holds(): the same checks hold per channel
        b.step = step
        b.pointers = b._pointers()
        b.rows, b.row_len = rows, weight.numel() // rows
        return b if b.quant_bound.holds(q) else None

    def _pointers(self) -> tuple:
        folded = (self.gamma.data_ptr(), self.var.data_ptr()) if self.bn is not None else ()
        return (self.weight.data_ptr(),) + folded + tuple(t.data_ptr() for t in self.step[:3]) \
            + (self.quant.scale.data_ptr(), self.quant.zero_point.data_ptr())

    def holds(self, module) -> bool:
        """Whether ``module`` still has everything this binding was made under (module doc)."""
        q, bn, w = module._modules.get("weight_quant"), self.bn, self.weight
        same_objects = (q is self.quant and module._parameters.get("weight") is w and module._modules.get("bn") is bn
                        and (bn is None or (bn._parameters.get("weight") is self.gamma
                                            and bn._buffers.get("running_var") is self.var and bn.eps == self.eps)))
        return (same_objects and w.requires_grad and (bn is None or self.gamma.requires_grad)
                and q._kernel and q._tracks_range and q.training and self.quant_bound.holds(q)
                and getattr(module, "weight_mask", None) is None and not watched(q)
                # the same memory, read as the same rows: .data = / .to() can change any of these
                and self._pointers() == self.pointers and w.dtype is _F32 and w.is_cpu and w.is_contiguous()
                and w.shape[0] == self.rows and w.numel() == self.rows * self.row_len
                and not (torch.jit.is_tracing() or torch.compiler.is_compiling()))

    def __call__(self) -> Optional[torch.Tensor]:
        """The weight as the per-layer route computes it (``fq_w(W * f) / f``, or ``fq_w(W)``), or
        None (nothing written) where its C++ step declines (the per-layer code decides)."""
        folded, q = self.bn is not None, self.quant
        f, std, keep = fold_factor_parts(self.gamma, self.var, self.eps, True) if folded else (self.ones, None, None)
        done = fold_track_forward(self.weight, f, *self.step[:8], q.scale, q.zero_point, folded, True)
        if done is None:
            return None
        return BoundWeightFunction.apply(self.weight, self.gamma, (done[0], done[1], f, std, keep))


class BoundWeightFunction(torch.autograd.Function):
    """``(weight, gamma or None, (out, mask, f, std, keep)) -> out``, computed by
    :class:`BoundWeight`; backward ``fold_backward`` (d weight, and d f for a folded layer, whose
    ``std`` / ``keep`` are set) then ``fold_factor_grad`` (d f -> d gamma); a plain layer with
    nothing clipped returns ``grad_out`` itself (``g * 1`` is ``g``)."""

    @staticmethod
    def forward(ctx, weight, gamma, done):
        out, ctx.mask, ctx.f, ctx.std, ctx.keep = done
        ctx.save_for_backward(weight, out)  # autograd checks at the backward that no one changed them
        # A plain layer's weight gradient is (g * m) * 1: where nothing was clipped (m all ones, as
        # for every symmetric min-max weight) that is g, bit for bit, as the per-layer route's
        # KernelOutputFunction returns it. A folded layer's ((g / f) * m) * f is not g: always a pass.
        rows = out.shape[0]
        ctx.identity = ctx.std is None and bool(native.library().dal_mask_all_set(
            ctx.mask.data_ptr(), rows, out.numel() // rows))
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        if ctx.identity:
            return grad_out.to(_F32).contiguous(), None, None
        weight, out = ctx.saved_tensors
        folded = ctx.std is not None
        grad_w, grad_f = fold_backward(grad_out, weight, ctx.f, ctx.mask, out, folded, True, folded)
        return grad_w, fold_factor_grad(grad_f, ctx.std, ctx.keep) if folded else None, None


def bound_weight(module) -> Optional[torch.Tensor]:
    """``module``'s training weight by its ``BoundWeight`` (bound or re-bound here as needed): a
    QConvBn2d's ``fq_w(W * f) / f`` (training, BN not frozen, 1/f on the weight: the caller's
    route), else ``fq_w(W)`` of its own weight Parameter; None: the per-layer code computes it."""
    b = module.__dict__.get("_weight_bound")
    if b is None or not b.holds(module):
        b = module.__dict__["_weight_bound"] = BoundWeight.of(module)
        if b is None:
            return None
    return b()
