"""Interleaved timing shared by the benches: each repetition runs every candidate once, in turn,
so a change in the machine's load hits all of them alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_times(runs: dict[str, Callable[[], object]], reps: int, clock: Callable[[], float] = time.perf_counter,
                      warmup: bool = False) -> dict[str, list[float]]:
    """ms of each callable in each of ``reps`` interleaved repetitions, read on ``clock``
    (``time.process_time`` for CPU time); ``warmup`` runs each once, untimed, first."""
    if warmup:
        for fn in runs.values():
            fn()
    times = {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            t = clock()
            fn()
            times[k].append((clock() - t) * 1e3)
    return times


def interleaved_medians(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time in ms of each callable over ``reps`` interleaved repetitions."""
    return {k: statistics.median(v) for k, v in interleaved_times(runs, reps).items()}
