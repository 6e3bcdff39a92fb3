"""torch's intra-op thread count held at the session's ``threads`` while a run's steps execute.

Some steps call torch on numpy memory (the float32 <-> float16 Casts, the softmax row maximum,
the fused chains' members): those calls run on torch's own intra-op pool, whose size is
``torch.get_num_threads()`` (by default the machine's cores), not
``dal.npu.load(threads=...)``: on a loaded machine a multi-threaded torch reduction waits for a descheduled worker
(bench/results/llm_npu.md). Inside :func:`torch_threads` (``Session.run``, ``profile``,
``run_layerwise``, ``run_teacher_forced``) torch's count is ``threads``; the caller's count is restored on exit,
also when a step raises. The count is process-wide state: another Python thread calling torch
during a run sees ``threads`` too. No result depends on it (every torch call a step makes is
exact or elementwise, hence independent of how it is split).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def torch_threads(n: int):
    """Inside the block ``torch.get_num_threads() == n`` (``n >= 1``); the previous count is
    restored on exit. Nothing is done when torch is not imported yet or already uses ``n``."""
    torch = sys.modules.get("torch")
    if n < 1:
        raise ValueError(f"torch_threads: n must be >= 1, got {n}")
    old = torch.get_num_threads() if torch is not None else n
    if old == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
