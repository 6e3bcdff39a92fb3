"""Make observers agree across processes: every rank ends up with the same statistics.

With ``torch.distributed`` initialised and more than one rank, per-batch statistics are
all-reduced before they update an observer's state, so scales are identical on every rank at
every step (DDP does not synchronise buffers that change inside forward by itself).

For FSDP2, learnable quantizer parameters: ``replicate_quantizer_parameters`` (the ones to leave
whole, their gradients averaged over ranks) and ``project_quantizer_parameters`` (the range
projection on sharded ones, after each optimizer step).
"""
from __future__ import annotations

import torch

from ..formats.qparams import MIN_SCALE


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



def replicate_quantizer_parameters(model: torch.nn.Module, shard_per_channel: bool = False
                                   ) -> set[torch.nn.Parameter]:
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
    lost. Registers its hook once per parameter (and marks it: ``p.dal_rank_mean_hook = True``);
    returns an empty set for a model without learnable quantizers.

    ``shard_per_channel=True`` returns only the 0-dim parameters: per-channel ``[out]`` and
    per-group ``[out, in / g]`` learnable scales are then sharded along dim 0 with their weights
    (a rank holds the scales of its own weight rows; 1 / world_size of their memory, which counts
    for a large language model's per-group scales), and the projection must reach the shards:
    call ``project_quantizer_parameters(optimizer, model)`` too.

    Raises ValueError naming the first empty parameter (a learnable scale is ``(0,)`` until
    calibration gives it its shape): calibrate before ``fully_shard``.
    """
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    if empty:
        raise ValueError(f"parameter {empty[0]!r} is empty (a learnable scale before calibration): "
                         "calibrate the model (dal.calibrate) before fully_shard")
    whole = {p for p in model.parameters() if p.dim() == 0}
    if not shard_per_channel:
        for m in model.modules():
            if hasattr(m, "project_learned_qparams_"):
                whole.update(m.parameters(recurse=False))
    for p in whole:
        if p.requires_grad and not getattr(p, "dal_rank_mean_hook", False):
            p.register_hook(_rank_mean)
            p.dal_rank_mean_hook = True
    return whole


def project_quantizer_parameters(optimizer: torch.optim.Optimizer, model: torch.nn.Module):
    """After every ``optimizer.step()``, put each learnable quantizer's parameters back in range,
    in place: ``scale >= MIN_SCALE`` and a learnable (LSQ+) zero point in ``[qmin, qmax]`` (the
    projection of ``FakeQuantizer.project_learned_qparams_``). On a sharded parameter (an FSDP2
    DTensor) it clamps the rank's local shard: a clamp is elementwise, so the shards together
    hold the projection of the full tensor, which the forward's own projection (into FSDP2's
    temporary all-gathered copy) does not leave behind. Values in range are left bit-identical;
    NaN stays NaN (the forward refuses it by name). Harmless without FSDP2 (the forward then
    finds nothing to project). For per-channel / per-group scales sharded with
    ``replicate_quantizer_parameters(model, shard_per_channel=True)``.

    Returns the hook's handle (``.remove()`` unregisters it).
    """
    mods = [m for m in model.modules() if hasattr(m, "project_learned_qparams_") and getattr(m, "learnable", False)]

    @torch.no_grad()
    def project(opt, args, kwargs) -> None:
        for m in mods:
            params = dict(m.named_parameters(recurse=False))
            scale, zp = params.get("scale"), params.get("zero_point")
            if scale is not None and scale.numel():
                _local(scale).clamp_(min=MIN_SCALE)
            if zp is not None and zp.requires_grad and zp.numel():
                _local(zp).clamp_(m.qmin, m.qmax)

    return optimizer.register_step_post_hook(project)


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage itself, under no_grad), else the tensor."""
    return p.to_local() if hasattr(p, "to_local") else p


def _rank_mean(grad: torch.Tensor) -> torch.Tensor:
    return all_reduce_(grad.clone(), "sum") / world_size()
