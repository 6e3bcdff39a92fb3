"""A per-tensor QAT quantizer's call with its tensors and constants bound once (``TrackCall``).

``track.kernel_fake_quantize`` decides at every call, from the quantizer, its observer and the
input, which kernel call applies: about twenty Python function calls and forty attribute
reads before the C++ kernel runs. In a warm loop that is ~20 us, but inside a training step
the convolutions between two quantizer calls evict the interpreter's code and data from the
caches, and the same path costs ~110 us (measured: a 36 us call became 178 us after streaming
32 MB through the caches). SSDlite's QAT step makes ~160 such calls.

A ``TrackCall`` holds what does not change from call to call for the commonest QAT quantizer,
per tensor with a running min / max or moving-average observer: the five buffers (the objects,
never their data pointers, which ``.data =`` can move), the C++ step's constants, and the share
memo's key. The caller (``dal.quantizer_bound``) re-checks at every call that the quantizer
still holds these very buffers in this configuration; this module checks what the tensors
themselves can change (dtype, device, size: ``.data =`` again) and everything about the input,
exactly as ``kernel_fake_quantize`` does. The computation is the same C++ call
(``dal_track_fq_forward``), so the bits are the same, and it declines (None, nothing written)
in every case where that path would decline, which then decides.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native
from .fused import KernelInPlaceFunction, KernelOutputFunction, kernel_mode, plain_tensor
from .qformat import QFormat
from .share import ShareStats, bump_versions, has_entry, share_or_compute
from .track import buffers_ok, step_args

_F32 = torch.float32


class TrackCall:
    """``kernel_fake_quantize(x, PER_TENSOR, fmt, qmin, qmax, scale, zero_point, step, stats)`` for
    one quantizer's ``step = (min_val, max_val, batches_seen, ema, fmt, symmetric, qmin, qmax)``:
    the same output and buffer writes, or None where that function must decide (module doc)."""

    __slots__ = ("tensors", "state", "counter", "consts", "mode", "keys")

    def __init__(self, min_val, max_val, batches_seen, ema, fmt: QFormat, symmetric: bool, qmin, qmax,
                 scale: torch.Tensor, zero_point: torch.Tensor):
        self.tensors = (min_val, max_val, batches_seen, scale, zero_point)
        self.state, self.counter = (min_val, max_val, scale, zero_point), batches_seen
        self.consts = step_args(ema, fmt, symmetric, qmin, qmax)
        self.mode = kernel_mode(fmt)
        # the share memo's key, as kernel_fake_quantize builds it (so bound and unbound calls share)
        tail = (ema, fmt, symmetric, qmin, qmax)
        self.keys = {need: (fmt, qmin, qmax, need) + tail for need in (False, True)}

    def tensors_ok(self) -> bool:
        """The bound buffers still one-element CPU tensors as the C++ step writes them (``track.buffers_ok``;
        ``.data =`` can change a tensor's dtype, device or size under the same object)."""
        mn, mx, bs, s, zp = self.tensors
        return s.numel() == 1 and zp.is_cpu and bs.is_cpu and buffers_ok(mn, mx, bs, s, zp)

    def __call__(self, x: torch.Tensor, stats: Optional[ShareStats]) -> Optional[torch.Tensor]:
        if not (x.is_cpu and x.dtype is _F32 and x.is_contiguous() and x.numel() and plain_tensor(x)
                and self.tensors_ok()):
            return None
        need = x.requires_grad and torch.is_grad_enabled()
        done = share_or_compute(x, self.keys[need], self.state, self.counter, lambda: self._compute(x, need), stats)
        if done is None:
            return None
        return KernelOutputFunction.apply(x, done) if need else done[0]

    def in_place(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """This call with the fake quantization written into ``x`` itself (the caller has proven
        that nothing else reads ``x``: ``dal.nn.sole_input``), behind ``KernelInPlaceFunction``;
        None, nothing written, where ``__call__`` must decide (also when a recorded call on ``x``
        could be shared). Training only: ``x`` needs a gradient."""
        if not (x.requires_grad and torch.is_grad_enabled() and x.is_cpu and x.dtype is _F32 and x.is_contiguous()
                and x.numel() and plain_tensor(x) and not x.is_leaf and x._base is None and self.tensors_ok()
                and not has_entry(x)):
            return None
        done = self._compute(x, True, x)  # the C++ step declines before it writes any value
        return None if done is None else KernelInPlaceFunction.apply(x, done)

    def _compute(self, x: torch.Tensor, need_mask: bool, out: Optional[torch.Tensor] = None) -> Optional[tuple]:
        """``track._track_fq``: the observer step and the fake quantization in one C++ call, into
        a new tensor or ``out`` (which may be ``x``: the kernel is elementwise)."""
        n = x.numel()
        out = torch.empty_like(x) if out is None else out
        mask = torch.empty((n + 7) // 8, dtype=torch.uint8) if need_mask else None
        mn, mx, bs, s, zp = self.tensors
        # the library is looked up per call (an lru_cache hit): a ctypes pointer would not pickle
        ok = native.library().dal_track_fq_forward(
            x.data_ptr(), out.data_ptr(), mask.data_ptr() if need_mask else None, n, mn.data_ptr(), mx.data_ptr(),
            bs.data_ptr(), *self.consts, s.data_ptr(), zp.data_ptr(), self.mode, torch.get_num_threads())
        if not ok:
            return None
        bump_versions(self.tensors)  # written in place by the C++ step
        return out, mask, 1, n
