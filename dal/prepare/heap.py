"""Keep freed host memory in the process during CPU QAT: glibc's heap trimming re-faults it every step.

A QAT training step allocates and frees more than the float step: each quantizer's output and
mask, kept for the backward (SSDlite320 at batch 2: ~420 MB live at the forward's peak against
~360 MB in float). glibc's ``malloc`` returns the top of its heap to the kernel whenever more
than ``M_TRIM_THRESHOLD`` of it is free, and by default that threshold follows the largest
block freed so far (twice it, at most 64 MiB). The QAT heap's top swings by more than that
within a step, so glibc gives ~40 MB back after the backward and the next forward takes it again
page by page: 12-16 thousand minor page faults per SSDlite step (16-48 ms of system time on a
250 ms float step), against 0-3 thousand for the float model, whose heap mostly settles.

:func:`retain_freed_memory` sets both of glibc's thresholds once for the process, as
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the environment would:

* ``M_MMAP_THRESHOLD`` = 32 MiB: blocks below it come from the heap and are reused. It is the
  most glibc's own dynamic rule would reach (setting any threshold turns that rule off, so it is
  pinned here rather than left at its 128 KiB start);
* ``M_TRIM_THRESHOLD`` = 512 MiB: the heap keeps up to that much freed memory for the next step
  instead of returning it.

The cost is resident memory: up to 512 MiB of freed heap stays mapped (it is reused, not
leaked). ``prepare_qat`` calls it; ``DAL_RETAIN_FREED_MEMORY=0`` in the environment opts out,
and it does nothing off glibc (macOS, Windows, musl) or where the user already set
``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` (their choice wins). Measured with
``tests/prepare/test_heap.py`` (a fresh process keeps the freed blocks, the opted-out one
returns them) and ``bench/detection.py``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20
OPT_OUT = "DAL_RETAIN_FREED_MEMORY"

_applied = [None]  # None: not tried yet; then True / False for the process


def retain_freed_memory() -> bool:
    """Set glibc's mmap / trim thresholds for this process once (module doc); True when they are
    set (now or by an earlier call), False where it does not apply or was opted out."""
    if _applied[0] is not None:
        return _applied[0]
    _applied[0] = False
    if os.environ.get(OPT_OUT, "1") == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _applied[0] = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied[0]
