"""Worker processes for the FSDP2 test (spawned; importable by module name): the same prepared,
calibrated MnistCNN trained on the same rank-dependent shards under FSDP2 (``fully_shard`` per QAT
layer plus the root, or on the root only) and under DDP, with full state dicts written per rank."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ddp_workers import _lsq_recipe, mnist_shard

MODES = ("fsdp2-per-layer", "fsdp2-root", "fsdp2-shard-then-calibrate", "ddp",
         "fsdp2-lsq", "fsdp2-lsq-sharded-scales", "ddp-lsq")
LAYERS = ("stem.0", "down.0", "conv", "down2.0", "head")  # MnistCNN(width=8)'s QAT modules with weights
STEPS = 4


def fsdp2_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every mode of ``MODES`` in turn, into ``out/<mode>/``."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mode in MODES:
            sub = os.path.join(out, mode)
            os.makedirs(sub, exist_ok=True)
            _scenario(rank, world, sub, mode)
        _record_lsq_refusal(out, x=mnist_shard(rank, world, n=32)[0])
    finally:
        dist.destroy_process_group()


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value: FSDP2 keeps a DTensor shard between forwards (all-gathered here)."""
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _scenario(rank: int, world: int, out: str, mode: str) -> None:
    """prepare -> calibrate (own shard; observers all-reduce) -> wrap -> STEPS SGD steps on this
    rank's batches (QAT: weight and activation observers update every forward); for the ways to
    wrap, ``_wrap``. Written per rank:
    the full state dict, the shapes each weight quantizer was called with, and the full head
    weight before every training forward."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import dal
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)  # same initial weights on every rank
    x, y = mnist_shard(rank, world, n=256)
    model = dal.prepare_qat(MnistCNN(width=8), _lsq_recipe() if "lsq" in mode else "int8_balanced",
                           "a2000", example_inputs=(x[:2],))
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]
    calibrate_first = mode != "fsdp2-shard-then-calibrate"
    if calibrate_first:
        dal.calibrate(model, batches[:3], progress=False)

    seen: dict[str, list] = {name: [] for name in LAYERS}
    for name in LAYERS:
        wq = model.get_submodule(name).weight_quant
        wq.register_forward_pre_hook(lambda m, args, name=name: seen[name].append(tuple(args[0].shape)))

    wrapped = _wrap(model, mode)
    if not calibrate_first:
        dal.calibrate(model, batches[:3], progress=False)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    head_weights = []
    for xb, yb in batches[3:3 + STEPS]:
        head_weights.append(_full(model.head.weight))
        opt.zero_grad()
        F.cross_entropy(wrapped(xb), yb).backward()
        opt.step()

    if mode.startswith("ddp"):
        sd = model.state_dict()
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    local_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if hasattr(p, "to_local")}
    save_sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}
    torch.save(save_sd, f"{out}/full_rank{rank}.pt")
    torch.save({"seen": seen, "head_weights": head_weights, "local_shapes": local_shapes},
               f"{out}/trace_rank{rank}.pt")


def _wrap(model, mode: str):
    """DDP (``ddp*``), or FSDP2: ``fully_shard`` on the root only (``fsdp2-root``) or on each QAT
    layer then the root; learnable scales (``*lsq``) left whole by ``replicate_quantizer_parameters``,
    or (``fsdp2-lsq-sharded-scales``) only the 0-dim ones, which ``fully_shard`` refuses to shard,
    with the same gradient mean over the two ranks."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dal.observers.distributed import all_reduce_, replicate_quantizer_parameters

    if mode.startswith("ddp"):
        return DDP(model, broadcast_buffers=False)  # FSDP2 keeps each rank's BN statistics too
    whole = None
    if mode.endswith("lsq"):
        whole = replicate_quantizer_parameters(model)
    elif mode.endswith("sharded-scales"):  # the per-channel scales are sharded with their weights
        whole = {p for p in model.parameters() if p.dim() == 0}
        for p in whole:
            if p.requires_grad:
                p.register_hook(lambda g: all_reduce_(g.clone(), "sum") / 2)
    if mode != "fsdp2-root":
        for name in LAYERS:
            fully_shard(model.get_submodule(name), ignored_params=whole)
    fully_shard(model, ignored_params=whole)
    return model


def _record_lsq_refusal(out: str, x: torch.Tensor) -> None:
    """What ``fully_shard`` says of a calibrated LSQ model without ``ignored_params``, into
    ``out/lsq_refusal.txt`` (rank 0; both ranks take part in calibration's all-reduces)."""
    from torch.distributed.fsdp import fully_shard

    import dal
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)
    model = dal.prepare_qat(MnistCNN(width=8), _lsq_recipe(), "a2000", example_inputs=(x[:2],))
    dal.calibrate(model, [x[:16]], progress=False)
    try:
        fully_shard(model.head)
        message = "accepted"
    except ValueError as e:
        message = str(e)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "lsq_refusal.txt"), "w") as f:
            f.write(message)
