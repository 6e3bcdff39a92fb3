"""Benchmark: cost of N:M sparsity, as ratios against peers measured in the same run.

1. 2:4 mask of a 4096x4096 float32 weight vs one ``w.abs()`` pass (the peer), interleaved,
   medians, one thread. ``w.abs()`` allocates a fresh 64 MiB output each call (page faults
   dominate it on these machines); the mask allocates its 16 MiB bool output and works in
   cache-sized chunks with reused scratch. A second peer, ``torch.abs(w, out=buf)`` into a
   reused buffer, is the strict memory-bandwidth floor and is printed too. topk + scatter
   (the obvious implementation) is shown for context.
2. Train step with and without 2:4 (float model; ``train_step_comparison``). The lead
   extends it to QAT + 2:4 vs QAT only (see the marked function).

Run: ``python bench/sparsity.py``.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import dal.sparsity as sp


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _topk_mask(w: torch.Tensor) -> torch.Tensor:
    a = w.abs().view(-1, 4)
    idx = a.topk(2, dim=-1).indices
    return torch.zeros_like(a, dtype=torch.bool).scatter_(1, idx, True).view_as(w)


def mask_vs_abs(size: int = 4096, reps: int = 15) -> dict:
    """Median seconds of mask / abs / abs-into-buffer / topk, measured interleaved."""
    torch.manual_seed(0)
    w = torch.randn(size, size)
    buf = torch.empty_like(w)
    runs = {"abs": lambda: w.abs(), "abs_out": lambda: torch.abs(w, out=buf),
            "mask": lambda: sp.nm_mask(w, 2, 4, axis=1)}
    times = {k: [] for k in runs}
    for f in runs.values():          # warm-up
        f()
    for _ in range(reps):
        for k, f in runs.items():
            times[k].append(_time(f))
    times["topk"] = [_time(lambda: _topk_mask(w)) for _ in range(3)]
    med = {k: statistics.median(v) for k, v in times.items()}
    assert torch.equal(sp.nm_mask(w, 2, 4, axis=1), _topk_mask(w)), "mask != topk reference"
    return med


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


# ============================================================================================
# EXTEND HERE (lead): QAT + 2:4 vs QAT-only train step. Build the two models with
# dal.prepare_qat(...) and, for the sparse one, dal.sparsity.prepare_sparse(...) too; keep
# the interleaved timing loop and the printed ratio.
# ============================================================================================
def train_step_comparison(reps: int = 10, make_model=_small_cnn) -> dict:
    """Median seconds of one SGD train step (forward, backward, step, controller.step) for a
    dense model and the same model with 2:4 masks, interleaved."""
    torch.manual_seed(0)
    dense, sparse = make_model(), make_model()
    sparse.load_state_dict(dense.state_dict())
    sp.prepare_sparse(sparse)
    ctl = sp.controller_of(sparse)
    x, y = torch.randn(8, 16, 32, 32), torch.randint(0, 10, (8,))
    opts = {"dense": torch.optim.SGD(dense.parameters(), lr=0.01, momentum=0.9),
            "sparse": torch.optim.SGD(sparse.parameters(), lr=0.01, momentum=0.9)}
    models = {"dense": dense, "sparse": sparse}

    def step(k):
        opts[k].zero_grad()
        nn.functional.cross_entropy(models[k](x), y).backward()
        opts[k].step()
        if k == "sparse":
            ctl.step()

    times = {k: [] for k in models}
    for k in models:
        step(k)
    for _ in range(reps):
        for k in models:
            times[k].append(_time(lambda: step(k)))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    med = mask_vs_abs()
    print("2:4 mask of a 4096x4096 float32 weight, 1 thread, medians (interleaved):")
    print(f"  w.abs() (allocating)      {med['abs'] * 1e3:8.1f} ms   peer")
    print(f"  abs into reused buffer    {med['abs_out'] * 1e3:8.1f} ms")
    print(f"  dal nm_mask 2:4           {med['mask'] * 1e3:8.1f} ms")
    print(f"  topk + scatter            {med['topk'] * 1e3:8.1f} ms")
    print(f"  ratio mask / w.abs()            = {med['mask'] / med['abs']:.2f}  (target <= 2)")
    print(f"  ratio mask / abs(out=buffer)    = {med['mask'] / med['abs_out']:.2f}")
    print(f"  ratio topk / w.abs()            = {med['topk'] / med['abs']:.2f}")
    tr = train_step_comparison()
    print("train step, small CNN, batch 8x16x32x32, SGD momentum, 1 thread, medians:")
    print(f"  dense {tr['dense'] * 1e3:.1f} ms, 2:4 {tr['sparse'] * 1e3:.1f} ms, "
          f"ratio {tr['sparse'] / tr['dense']:.2f}")


if __name__ == "__main__":
    main()
