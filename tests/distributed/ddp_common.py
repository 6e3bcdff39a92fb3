"""Comparing per-rank state_dicts."""
from __future__ import annotations

import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_bn_running_stat(key: str) -> bool:
    """BN running statistics are updated locally by each rank's batch *after* DDP broadcast rank
    0's copy at the start of the forward: they differ between ranks between steps, by design
    (DDP semantics: rank 0's buffers are authoritative, and every forward starts from them)."""
    return key.endswith(("bn.running_mean", "bn.running_var"))


def differing(a: dict, b: dict, skip=lambda k: False) -> list[str]:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return [k for k in a if not skip(k) and not (a[k].shape == b[k].shape and torch.equal(a[k], b[k]))]
