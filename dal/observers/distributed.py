"""Make observers agree across processes: every rank ends up with the same statistics.

With ``torch.distributed`` initialised and more than one rank, per-batch statistics are
all-reduced before they update an observer's state, so scales are identical on every rank at
every step (DDP does not synchronise buffers that change inside forward by itself).
"""
from __future__ import annotations

import torch


def _active() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_(t: torch.Tensor, op: str) -> torch.Tensor:
    """In-place all-reduce with op "min", "max" or "sum"; a no-op in a single process."""
    if _active():
        dist = torch.distributed
        ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
        dist.all_reduce(t, op=ops[op])
    return t


def world_size() -> int:
    return torch.distributed.get_world_size() if _active() else 1
