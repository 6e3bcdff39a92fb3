"""Two real processes (gloo on localhost): ranks see different data and end with identical
statistics, equal to one process that saw all of it."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dal.formats as F
from dal.observers import make_observer

CONFIGS = [("minmax", F.PER_TENSOR), ("minmax", F.per_channel(1)), ("moving_average", F.PER_TENSOR),
           ("percentile", F.PER_TENSOR), ("kl", F.PER_TENSOR), ("mse", F.PER_TENSOR)]
STEPS = 4


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 3, 5, generator=g) * (1 + rank + step)  # ranks see different ranges
    if rank == 1 and step == 2:
        x[0, 0, 0] = float("nan")
    return x


def _observers():
    return [make_observer(n, "int8", g, symmetric=(n != "minmax" or g.axis is None)) for n, g in CONFIGS]


def _worker(rank, port, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        obs = _observers()
        for step in range(STEPS):
            for o in obs:
                o(_batch(rank, step))
        result = [({k: v for k, v in o.state_dict().items() if k != "nonfinite_count"}, o.calculate_qparams())
                  for o in obs]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_agree_and_equal_single_process(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    single = _observers()
    for step in range(STEPS):
        both = torch.cat([_batch(0, step), _batch(1, step)])
        for o in single:
            o(both)
    for (name, gran), (sd0, qp0), (sd1, qp1), o in zip(CONFIGS, r0, r1, single):
        assert sd0.keys() == sd1.keys()
        for k in sd0:
            assert torch.equal(sd0[k], sd1[k]), f"{name} {gran}: ranks differ in {k}"
            assert torch.equal(sd0[k], o.state_dict()[k]), f"{name} {gran}: {k} differs from one process"
        s, z = o.calculate_qparams()
        assert torch.equal(qp0[0], qp1[0]) and torch.equal(qp0[0], s), f"{name} {gran}: scale"
        assert torch.equal(qp0[1], qp1[1]) and torch.equal(qp0[1], z), f"{name} {gran}: zero point"
