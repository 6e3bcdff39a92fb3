"""Multi-scale deformable attention recognised in its pure-PyTorch form (export/SPEC.md §5g).

Deformable-DETR's reference ``ms_deform_attn_core_pytorch``, BEVFormer's and transformers'
``multi_scale_deformable_attention`` all compute, per level, ``F.grid_sample(value_l, 2 * loc - 1)``
and then a weighted sum ``(stack(samples) * attention_weights).sum(-1)``, with
``loc = reference_points + offsets / normalizer``. In a forward torch.fx cannot trace (they iterate
over a tensor of level shapes) prepare sees these calls by call site (``call_sites``, helper
functions included); this module reads the discovery forward's data flow (``call_sites.Call``)
and finds, per owner:

- the **weighted sum**: a quantizable ``*`` one of whose operands descends from grid_sample
  outputs and the other not, and whose result reaches a ``.sum``;
- the **sampling arithmetic**: the quantizable ``+`` / ``*`` from which some grid_sample's grid
  descends (``reference_points + offsets / normalizer``).

Only an owner with a weighted sum is a deformable attention. Its roles get the op class
``deformable_attention`` (``dal.hardware.op_classes``): a recipe rule ``type: deformable_attention``
gives their formats (int16 in int8_balanced, as Horizon's J6 quantizes sampling offsets and
attention weights; fp16 in int8_deform_fp16, as NVIDIA's plugin), checked against the hardware's
``ops.deformable_attention``; without such a rule they keep their add / mul rule. The per-level
grid_samples stay ``grid_sample`` (the value's int8 codes, int16 grid, §5b).
"""
from __future__ import annotations

import dataclasses

OP_CLASS = "deformable_attention"
ROLES = ("sampling", "weights")


def deformable_roles(sites: list, flow: list) -> dict[str, str]:
    """``{site path: "sampling" | "weights"}`` for the quantizable add / mul call sites of a
    deformable attention (module doc), read from ``flow`` (the :class:`~dal.prepare.call_sites.Call`
    list of one discovery forward, every owner's calls in call order); ``{}`` when there is none.
    The flow is read across owners: transformers computes the sampling locations in
    ``DeformableDetrMultiscaleDeformableAttention`` and samples them in its child
    ``MultiScaleDeformableAttention``, two owners joined by the tensors one passes the other."""
    by_key = {(s.owner, s.key): s for s in sites}
    producer: dict[int, int] = {}
    arg_parents: list[list] = []
    for i, call in enumerate(flow):
        arg_parents.append([producer.get(id(t)) for t in call.args])
        for t in call.outputs:
            producer[id(t)] = i
    site = [by_key.get((c.owner, c.key)) if c.key is not None else None for c in flow]
    is_gs = [s is not None and s.kind == "grid_sample" for s in site]
    from_gs = []  # the call's result descends from a grid_sample output
    for i in range(len(flow)):
        from_gs.append(is_gs[i] or any(p is not None and from_gs[p] for p in arg_parents[i]))
    weights = []
    for i, s in enumerate(site):
        if s is None or s.kind != "mul" or len(arg_parents[i]) < 2:
            continue
        a, b = arg_parents[i][:2]
        if (a is not None and from_gs[a]) != (b is not None and from_gs[b]) and _reaches_sum(i, arg_parents, site):
            weights.append(i)
    if not weights:
        return {}
    roles = {site[i].path: "weights" for i in weights}
    for i in (i for i in range(len(flow)) if is_gs[i]):
        grid = arg_parents[i][1] if len(arg_parents[i]) > 1 else None
        for j in _ancestors(grid, arg_parents):
            if site[j] is not None and site[j].kind in ("add", "mul") and not from_gs[j]:
                roles.setdefault(site[j].path, "sampling")
    return roles


def _reaches_sum(start: int, arg_parents: list, site: list) -> bool:
    reached = {start}
    for j in range(start + 1, len(arg_parents)):
        if any(p in reached for p in arg_parents[j] if p is not None):
            reached.add(j)
            if site[j] is not None and site[j].op is not None and site[j].op.function == "sum":
                return True
    return False


def _ancestors(start, arg_parents: list) -> set:
    seen, todo = set(), [start] if start is not None else []
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        todo += [p for p in arg_parents[i] if p is not None]
    return seen


def deformable_step(step, role: str, resolve):
    """``step`` (a quantized add / mul call site of a deformable attention) with op class
    ``deformable_attention`` and the spec of the recipe rule for that class, or unchanged when the
    recipe has none (then its add / mul rule decides)."""
    spec = resolve(step.path, OP_CLASS, OP_CLASS)
    if spec is None or step.action != "functional":
        return step
    what = "sampling arithmetic (reference points + offsets)" if role == "sampling" else \
        "attention-weighted sum of the sampled values"
    if spec.fallback_fp16 and role == "sampling":
        # An FP16 add here makes the exporter pull the grid's ``2 * loc - 1`` into the FP16 region
        # (Mul, Sub in float16), which the trained model computes in float32 (SPEC §5a: the tail
        # of an FP16 region): float32 instead, the grid still int16 at the grid_sample.
        return dataclasses.replace(step, action="float", spec=None, built="", reason=(
            f"{step.reason}; deformable attention's {what}: float32 under an fp16 rule (an FP16 add would carry "
            "the grid arithmetic after it into float16), the grid quantized int16 at its grid_sample (SPEC §5g)"))
    return dataclasses.replace(step, op_class=OP_CLASS, spec=spec,
                               reason=f"{step.reason}; deformable attention's {what} (export/SPEC.md §5g)")
