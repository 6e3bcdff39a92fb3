"""One tensor read by two activation quantizers with the same state: fake-quantized once.

A tensor often feeds two quantizers of one configuration: a ResNet block's input is the next
conv's ``input_quant`` and the residual ``QAdd``'s ``input_quants.1``; a downsampling block's
input is ``conv1``'s and ``downsample.0``'s. The two have seen the same tensors since
calibration, so their observers hold the same range and their scales are equal, and each QAT
step computes the same range pass, observer step and fake quantization twice (ResNet-18 at
224x224: 8 such pairs, 8.2 M of the 29.5 M activation values a step quantizes).

:func:`share_or_compute` runs a quantizer's kernel call (``dal.formats.track``) and remembers,
per input tensor, what the call read and wrote; a later call on the same tensor whose result is
provably the same bits takes it instead of computing. Provably, because the C++ call
(``dal_track_fq_forward`` / ``dal_fq_forward_fixed``) is a function of exactly these:

* the input: the same tensor object at the same ``_version`` (no in-place write in between);
* the call's constants: format, code range, observer kind and its constant, per tensor, with
  or without a mask for the gradient (``key``);
* the state it reads: the bytes of ``min_val`` / ``max_val`` / ``scale`` / ``zero_point``
  (running range, or the fixed scale) before the call equal to the first call's;
* the first call's output still alive and unwritten (its ``_version``).

Under ``torch.inference_mode`` (and for inference tensors) nothing is shared: they carry no
version counter, so "unwritten since" cannot be proven.

It then writes the first call's post-call bytes into the same buffers, adds one to
``batches_seen`` (which no value depends on) and bumps the version counters as the C++ call
does: every buffer ends as the call would have left it. A learnable scale never gets here (it
takes the eager path), nor do tracing or compiling (``fused.kernel_layout`` refuses them, so
an exported graph keeps one quantizer per input, as written).

Why a memo keyed by the input tensor, not a tie decided at prepare time: the pairs are not all
visible to the fx graph (FCOS's heads and call-site quantizers run under a torch function
mode), a tie would still have to check at every call that the two states have not diverged
(``set_qparams`` on one of them, a checkpoint loaded into one), and a memo needs no change
to what ``prepare_qat`` builds or saves. The memo holds only weak references (to the input,
the output and the mask), so it keeps no tensor alive: an entry goes when its input tensor
dies, and one whose output died is ignored.

The second quantizer's output is a new tensor with its own autograd node (``grad * mask``
with the first call's mask) sharing the first output's storage, as ``detach()`` does. The
backward is then exactly today's: each quantizer's gradient is masked on its own and autograd
sums the two into the input's gradient in the same order (masking the summed gradient once
would differ in the sign of zeros and where the sum overflows). The storage is shared: an
in-place write to one output writes the other, which autograd reports where the other was
saved for a backward; dal's modules only read a quantizer's output (conv, linear, add, cat).

Recording an entry (two byte snapshots of the state, three weak references) costs about as much
as the kernel call on a small tensor, and most quantizers' inputs feed no second quantizer. So a
caller may pass its ``ShareStats``: once its first ``PROBE_CALLS`` entries have all gone untaken
it stops recording (its calls still take another's entry). Four: a pair is two quantizers that
have seen the same tensors since calibration, so the second takes the first's entry from the
first QAT step on; with sixteen, a detector paid the recording on every call of its first
sixteen steps (~1000 byte snapshots a step in SSDlite). Only the speed depends on it: a call
that finds no entry computes, and the bits are the same either way.

:func:`sharing` switches the memo off for a block (the reference path of the tests).
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import Callable, Iterator, Optional

import torch
from torch.autograd.graph import increment_version

_LOCAL = threading.local()  # DataParallel runs replicas in threads: one memo per thread
_ENABLED = [True]


@contextlib.contextmanager
def sharing(enabled: bool = True) -> Iterator[None]:
    """``with sharing(False):`` every quantizer call in the block computes its own output (the
    reference for tests; the results are the same bits either way). Restored on exit."""
    saved = _ENABLED[0]
    _ENABLED[0] = bool(enabled)
    try:
        yield
    finally:
        _ENABLED[0] = saved


def sharing_enabled() -> bool:
    """Whether :func:`share_or_compute` may reuse a result (True unless switched off)."""
    return _ENABLED[0]


#: a caller whose first this many recorded entries no later call took stops recording (module doc)
PROBE_CALLS = 4


class ShareStats:
    """One caller's record (a quantizer's): entries it recorded, and how many were taken."""

    __slots__ = ("recorded", "taken")

    def __init__(self):
        self.recorded = self.taken = 0

    def records(self) -> bool:
        """Whether the caller's next result is worth recording."""
        return self.taken > 0 or self.recorded < PROBE_CALLS


class _Entry:
    __slots__ = ("x", "x_version", "out", "out_version", "mask", "rows", "row_len", "pre", "post", "stats")


def _memo() -> dict:
    memo = getattr(_LOCAL, "memo", None)
    if memo is None:
        memo = _LOCAL.memo = {}
    return memo


def bump_versions(tensors: tuple) -> None:
    """Autograd's version counter of each tensor += 1 (buffers a C++ call wrote in place), in one
    call where torch takes a tuple (>= 2.5), else one call per tensor (pyproject allows 2.4)."""
    try:
        increment_version(tensors)
    except TypeError:
        for t in tensors:
            increment_version(t)


def _state(tensors: tuple) -> tuple:
    return tuple(ctypes.string_at(t.data_ptr(), t.nbytes) for t in tensors)


def has_entry(x: torch.Tensor) -> bool:
    """Whether some call has recorded ``x`` (a later call may take that entry)."""
    memo = getattr(_LOCAL, "memo", None)
    return memo is not None and id(x) in memo


def share_or_compute(x: torch.Tensor, key: tuple, state: tuple, counter: Optional[torch.Tensor],
                     compute: Callable[[], Optional[tuple]], stats: Optional[ShareStats] = None) -> Optional[tuple]:
    """``compute()`` — a kernel call on ``x`` returning ``(out, mask, rows, row_len)`` or None —
    or the same tuple from an earlier call on ``x`` that is provably the same bits (module doc).

    ``key``: the call's constants (hashable); ``state``: the CPU tensors the call reads, and
    writes when it has a ``counter`` (same dtypes and sizes for every caller with this key);
    ``counter``: the int64 tensor an observer step increments (``batches_seen``), or None for a
    call with fixed parameters, which writes nothing. A reused observer step writes the first
    call's post-call ``state`` bytes and increments ``counter``, bumping their versions.
    ``stats``: the caller's record; recording stops once it shows no taker (module doc)."""
    if not _ENABLED[0] or x.is_inference() or torch.is_inference_mode_enabled():
        return compute()  # inference tensors have no version counter to prove "unwritten" with
    memo = _memo()
    entries = memo.get(id(x))
    e = entries.get(key) if entries is not None else None
    pre = None
    if e is not None and e.x() is x and e.x_version == x._version:
        pre = _state(state)
        out = e.out() if e.pre == pre else None
        mask = e.mask() if e.mask is not None else None
        if out is not None and out._version == e.out_version and (mask is not None) == (e.mask is not None):
            if counter is not None:  # the observer's step: written as the C++ call writes it, versions bumped
                for t, b in zip(state, e.post):
                    ctypes.memmove(t.data_ptr(), b, len(b))
                ctypes.c_int64.from_address(counter.data_ptr()).value += 1
                bump_versions(state + (counter,))
            if e.stats is not None:
                e.stats.taken += 1
            return out.detach(), mask, e.rows, e.row_len
    if stats is not None and not stats.records():
        return compute()
    if pre is None:
        pre = _state(state)
    done = compute()
    if done is None:
        return None
    if entries is None:
        k = id(x)
        entries = memo[k] = {}
        # The entry goes with its input: the callback runs when x is freed, before its id can be reused.
        entries["ref"] = weakref.ref(x, lambda _r, k=k, m=memo: m.pop(k, None))
    e = _Entry()
    e.x, e.x_version, e.out, e.out_version = entries["ref"], x._version, weakref.ref(done[0]), done[0]._version
    e.mask = weakref.ref(done[1]) if done[1] is not None else None
    e.rows, e.row_len, e.pre, e.post, e.stats = done[2], done[3], pre, _state(state), stats
    entries[key] = e
    if stats is not None:
        stats.recorded += 1
    return done
