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



def replicate_quantizer_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters of a calibrated ``model``'s quantizers (learnable scales, zero points and
    log2 scales, LSQ / LSQ+: those of every module with ``project_learned_qparams_``) and any
    other 0-dim parameter, made replicated data-parallel parameters for FSDP2.

    Pass the returned set as ``ignored_params=`` to every ``torch.distributed.fsdp.fully_shard``
    call: FSDP2 then leaves these (small) parameters whole on every rank, and a gradient hook
    registered here replaces each one's gradient ``g`` by ``all_reduce(g, SUM) / world_size``
    (the ranks' mean, as DDP and FSDP2 average the other gradients; the identity in a single
    process), so every rank takes the same step and the scales stay identical. Why not shard
    them: ``fully_shard`` refuses 0-dim parameters ("doesn't support scalar parameters"), and a
    quantizer's forward projects a learned scale an optimizer step pushed out of range back into
    it in place, which on a sharded parameter lands in FSDP2's temporary all-gathered copy and is
    lost. Registers its hook once per parameter; returns an empty set for a model without learnable
    quantizers.

    Raises ValueError naming the first empty parameter (a learnable scale is ``(0,)`` until
    calibration gives it its shape): calibrate before ``fully_shard``.
    """
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    if empty:
        raise ValueError(f"parameter {empty[0]!r} is empty (a learnable scale before calibration): "
                         "calibrate the model (dal.calibrate) before fully_shard")
    whole = {p for p in model.parameters() if p.dim() == 0}
    for m in model.modules():
        if hasattr(m, "project_learned_qparams_"):
            whole.update(m.parameters(recurse=False))
    for p in whole:
        if p.requires_grad and not getattr(p, "_dal_rank_mean_hook", False):
            p.register_hook(_rank_mean)
            p._dal_rank_mean_hook = True
    return whole


def _rank_mean(grad: torch.Tensor) -> torch.Tensor:
    return all_reduce_(grad.clone(), "sum") / world_size()
