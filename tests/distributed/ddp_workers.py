"""Worker processes for the multi-process tests (spawned; importable by module name)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def mnist_shard(rank: int, world: int, n: int = 1024):
    from dal_examples.datasets import load_mnist

    x, y = load_mnist()["train"]
    x, y = (x[:n] - 0.1307) / 0.3081, y[:n]
    return x[rank::world], y[rank::world]  # different data on every rank


def save(model, path):
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)


def plain_ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    """Both orders (calibrate then wrap in DDP, as a user loop does; wrap then calibrate, as a
    Lightning callback does), each into ``out/<order>/``."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for wrap_first in (False, True):
            sub = os.path.join(out, "wrap-then-calibrate" if wrap_first else "calibrate-then-wrap")
            os.makedirs(sub, exist_ok=True)
            _scenario(rank, world, sub, wrap_first)
        sub = os.path.join(out, "lsq")
        os.makedirs(sub, exist_ok=True)
        _scenario(rank, world, sub, False, recipe=_lsq_recipe())
    finally:
        dist.destroy_process_group()


def _lsq_recipe() -> dict:
    """int8_balanced with learnable (LSQ / LSQ+) scales on every conv / linear weight and input."""
    import dal

    rec = dal.load_recipe("int8_balanced").to_dict()
    rec["name"] = "int8_lsq"
    for rule in rec["rules"]:
        for role in ("weight", "input"):
            if isinstance(rule.get(role), dict) and set(rule.get("type", ())) & {"conv", "linear"}:
                rule[role]["learnable"] = True
    return rec


def _scenario(rank: int, world: int, out: str, wrap_before_calibration: bool, recipe="int8_balanced") -> None:
    """prepare -> calibrate (own shard) -> DDP -> QAT steps (moving-average qparams update each
    step) -> frozen steps; state_dicts written at each stage, per rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dal
    from dal.prepare.state import set_quantizer_state
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
    x, y = mnist_shard(rank, world)
    model = dal.prepare_qat(MnistCNN(width=8), recipe, "a2000", example_inputs=(x[:2],))
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]
    ddp = DDP(model) if wrap_before_calibration else None
    dal.calibrate(model, batches[:3], progress=False)
    save(model, f"{out}/calib_rank{rank}.pt")
    ddp = ddp or DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    for xb, yb in batches[3:9]:
        opt.zero_grad()
        F.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    save(model, f"{out}/train_rank{rank}.pt")
    set_quantizer_state(model, "frozen")
    for xb, yb in batches[9:12]:
        opt.zero_grad()
        F.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    save(model, f"{out}/frozen_rank{rank}.pt")
