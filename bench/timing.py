"""Interleaved timing shared by the benches: each repetition runs every candidate once, in turn,
so a change in the machine's load hits all of them alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_medians(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time in ms of each callable over ``reps`` interleaved repetitions."""
    times = {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}
