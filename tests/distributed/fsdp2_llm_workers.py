"""Worker processes for the FSDP2 LLM test (spawned; importable by module name): a tiny
LlamaForCausalLM (transformers, built from its config) prepared with a W4A8 recipe (INT4 weights
per group of 32 along the input, the last linear INT8 per channel), calibrated, then sharded with
``fully_shard`` per decoder layer plus the root and trained for ``STEPS`` SGD steps, each rank on
its own half of every batch. After the process group is gone, rank 0 replays the same steps on
an unsharded copy in one process (the reference), the two halves as micro-batches.

Per mode of ``MODES`` (a variant of the recipe, ``recipe_for``), written to ``out/<mode>/``:
``fsdp_rank{r}.pt`` and ``ref.pt``, each ``{"loss": [per step], "quant": [per step: {name:
tensor}]}``: this rank's (the reference's half-``r``) loss, and after every step every
quantizer's scale / zero point / observer range, gathered to full tensors. ``LIVE`` (the recipe
with activation observers updating in the steps) is trained sharded only: ``fsdp_rank{r}.pt``.
"""
from __future__ import annotations

import copy
import os

import torch

MODES = ("recipe", "lsq", "lsq-sharded", "lsq-sharded-projected")
LIVE = "recipe-live"  # the recipe with activation observers live in the steps: no reference
STEPS = 4
BATCH, SEQ = 4, 16  # per step; a rank gets BATCH // world rows
QUANT_STATE = ("scale", "zero_point", "observer.min_val", "observer.max_val")


def base_recipe() -> str:
    """The W4 per-group LLM recipe: another engineer's ``w4a8_fp8_llm`` once it exists, else
    ``w4a8_fp8_performance`` (INT4 per group of 32 on every linear weight but the last)."""
    import dal

    names = dal.recipe.list_recipes()
    return "w4a8_fp8_llm" if "w4a8_fp8_llm" in names else "w4a8_fp8_performance"


def recipe_for(mode: str) -> dict:
    """``recipe``: ``base_recipe()`` as it is (in QAT the per-group and per-channel weight scales
    follow the weights at every step); ``lsq*``: every linear weight scale learnable (LSQ),
    initialised by the recipe's calibration. ``lsq`` leaves the scales whole on every rank
    (``replicate_quantizer_parameters``), ``lsq-sharded`` lets ``fully_shard`` shard them along
    dim 0 with their weights ([out, in / 32] -> [out / 2, in / 32]) at a learning rate that
    keeps them in range; ``lsq-sharded-projected`` shards them too
    (``replicate_quantizer_parameters(model, shard_per_channel=True)``) at the weights' learning
    rate, which pushes some below MIN_SCALE, and projects the shards after every step
    (``project_quantizer_parameters``)."""
    import dal

    rec = dal.load_recipe(base_recipe()).to_dict()
    rec["name"] = f"{rec['name']}_{mode.replace('-', '_')}"
    for rule in rec["rules"]:
        w = rule.get("weight")
        if mode.startswith("lsq") and isinstance(w, dict) and "linear" in rule.get("type", ()):
            rule["weight"] = dict(w, learnable=True)
    return rec


def tiny_llama():
    import transformers as T

    cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256, max_position_embeddings=128)
    return T.LlamaForCausalLM(cfg)


def data():
    """(calibration batches, training batches): the same on every rank (a seeded generator)."""
    g = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(2)]
    train = [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    return calib, train


def quant_state(model) -> dict[str, torch.Tensor]:
    """Every quantizer's scale / zero point / observer range (weights and activations), full
    tensors (a sharded Parameter is gathered with ``DTensor.full_tensor``, which all ranks must
    call together)."""
    from dal.quantizer import quantizers

    out = {}
    for qname, q in quantizers(model):
        for name, t in [*q.named_parameters(), *q.named_buffers()]:
            if name in QUANT_STATE and t.numel():
                full = t.full_tensor() if hasattr(t, "full_tensor") else t
                out[f"{qname}.{name}"] = full.detach().clone()
    return out


def freeze_activation_quantizers(model) -> None:
    """Activation scales stay at their calibrated values during the steps (weight quantizers keep
    their QAT state): the reference then sees the ranks' halves one after the other and still
    quantizes them as the ranks do. (Cross-rank activation observers: tests/distributed/test_fsdp2.py.)"""
    from dal.quantizer import quantizers

    for name, q in quantizers(model):
        if not name.endswith("weight_quant") and q.state == "quantize":
            q.set_state("frozen")


def prepared(mode: str):
    import dal

    torch.manual_seed(0)  # same initial weights on every rank
    model = dal.prepare_qat(tiny_llama(), recipe_for(mode), "a2000")
    calib, _ = data()
    dal.calibrate(model, calib, progress=False)
    if mode != LIVE:
        freeze_activation_quantizers(model)
    return model


def optimizer(model, mode: str):
    """SGD; the learnable scales at a rate that keeps them positive (a step that pushes one below
    MIN_SCALE is projected back in the next forward, which a sharded scale loses: README), except
    in ``lsq-sharded-projected``, with ``project_quantizer_parameters`` (in the reference too:
    the projection after the step instead of in the next forward, the same numbers)."""
    from dal.observers.distributed import project_quantizer_parameters

    quant = [p for n, p in model.named_parameters() if "_quant." in n]
    rest = [p for n, p in model.named_parameters() if "_quant." not in n]
    slow = quant and mode != "lsq-sharded-projected"
    groups = [{"params": rest}] + ([{"params": quant, "lr": 1e-4 if slow else 0.05}] if quant else [])
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if mode == "lsq-sharded-projected":
        project_quantizer_parameters(opt, model)
    return opt


def llm_worker(rank: int, world: int, port: int, out: str) -> None:
    """Every mode sharded over the process group, then (rank 0) every mode's reference."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    unsharded = {}
    try:
        for mode in MODES:
            os.makedirs(os.path.join(out, mode), exist_ok=True)
            model = prepared(mode)
            unsharded[mode] = copy.deepcopy(model)  # calibrated, before fully_shard changes it
            torch.save(_train_sharded(model, mode, rank, world), os.path.join(out, mode, f"fsdp_rank{rank}.pt"))
        os.makedirs(os.path.join(out, LIVE), exist_ok=True)
        torch.save(_train_sharded(prepared(LIVE), LIVE, rank, world), os.path.join(out, LIVE, f"fsdp_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        for mode in MODES:
            torch.save(_train_reference(unsharded[mode], mode, world), os.path.join(out, mode, "ref.pt"))


def _train_sharded(model, mode: str, rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from dal.observers.distributed import replicate_quantizer_parameters

    # empty without learnable quantizers; lsq-sharded: nothing left whole
    whole = set() if mode == "lsq-sharded" else \
        replicate_quantizer_parameters(model, shard_per_channel=mode == "lsq-sharded-projected")
    for layer in model.model.layers:
        fully_shard(layer, ignored_params=whole)
    fully_shard(model, ignored_params=whole)
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if hasattr(p, "to_local")}
    opt = optimizer(model, mode)
    log = {"loss": [], "quant": [], "local_shapes": local}
    _, train = data()
    for ids in train:
        half = ids[rank::world]
        opt.zero_grad()
        loss = model(half, labels=half).loss
        loss.backward()
        opt.step()
        log["loss"].append(loss.detach().clone())
        log["quant"].append(quant_state(model))
    return log


def _train_reference(model, mode: str, world: int) -> dict:
    """The same steps unsharded in one process: each rank's half as a micro-batch, gradients
    accumulated and divided by ``world`` (FSDP2's mean over ranks)."""
    opt = optimizer(model, mode)
    log = {"loss": [], "quant": []}
    _, train = data()
    for ids in train:
        opt.zero_grad()
        losses = []
        for r in range(world):
            half = ids[r::world]
            loss = model(half, labels=half).loss
            loss.backward()
            losses.append(loss.detach().clone())
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(world)
        opt.step()
        log["loss"].append(losses)
        log["quant"].append(quant_state(model))
    return log
