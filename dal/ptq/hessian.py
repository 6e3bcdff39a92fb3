"""Layer-by-layer second-order PTQ of a prepared model: which QLinears (and plain QConv2ds:
``supported``), in which passes, and the
Hessian ``H = 2/N sum_n x_n x_n^T`` of each one's input (``x_n``: the rows of the input the
weight multiplies, i.e. after the layer's input quantizer, over all calibration batches).

Linears that are called on the same input tensor (q / k / v; gate / up) share one Hessian, and
their weights are solved together (``ColumnGrid`` stacks them by rows). A *stage* is the set
of such input groups whose Hessians are captured in one pass over the calibration data; the
pass stops right after the stage's last input has been seen (``StopForward``), then the stage
is solved and its weights written, so every later stage sees the already quantized outputs:

* ``sequential="block"`` (default): one stage per block of a ``nn.ModuleList`` (a decoder
  layer), joined by the linears outside any block that follow it (a head); inside a stage, a
  layer sees its stage-mates with their calibrated round-to-nearest weights. When the blocks
  run as a chain (``dal.ptq.replay.chains``) and ``replay`` is on, the pass for block ``b``
  runs only blocks ``b-1`` and ``b``: blocks ``0 .. b-2`` are replayed from the outputs block
  ``b-2`` gave in the previous pass (exactly the same forward), so all passes together cost
  about two forwards; else each pass runs the whole prefix, about ``(L + 1) / 2`` forwards
  for ``L`` blocks.
* ``sequential="layer"``: one stage per input group: every layer sees the solved weights of
  every layer before it (more passes).

Memory: one Hessian per input group of the current stage (``d_in^2`` each) and, with replay, one
block's outputs for every calibration batch (tokens x hidden values: 4 GiB of float32 for 128
sequences of 2048 tokens at width 4096; ``replay=False`` keeps no activations, at the price of
the prefix passes). The calibration batches themselves are materialised once. During a pass the weight quantizers of the layers already solved are ``off``: their
weights are on the grid (``(code - z) * s``), so that is the same forward without the fake
quantization of those weights.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..calibration.batches import iter_inputs
from ..nn.conv import QConv2d
from ..nn.linear import QLinear
from ..nn.modes import eval_mode
from .layers import StopForward, run_hooked

SEQUENTIAL = ("block", "layer")


@dataclass
class InputGroup:
    """Linears fed one input tensor, in execution order; ``block``: the ModuleList entry holding them."""

    names: list
    modules: list
    block: Optional[str]
    hessian: Optional[torch.Tensor] = None
    rows: int = 0
    extra: dict = field(default_factory=dict)


def supported(mod: nn.Module) -> bool:
    """A QLinear, or a QConv2d with ``groups == 1``, numeric zero padding and per-tensor or
    per-output-channel weight scales (its weight is then a ``out x (in * kh * kw)`` matrix over
    the unfolded input patches). Depthwise / grouped convs and QConvBn2d are left alone."""
    if isinstance(mod, QLinear):
        return True
    if not isinstance(mod, QConv2d) or mod.groups != 1 or mod.padding_mode != "zeros" or isinstance(mod.padding, str):
        return False
    wq = getattr(mod, "weight_quant", None)
    return wq is None or not wq.granularity.block_size


def layer_rows(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows ``x_n`` the weight matrix multiplies: the last dim for a linear, the unfolded
    ``in * kh * kw`` patches (``F.unfold``'s order, that of ``weight.reshape(out, -1)``) for a conv."""
    if isinstance(mod, nn.Conv2d):
        x = F.unfold(x, mod.kernel_size, mod.dilation, mod.padding, mod.stride)
        return x.transpose(1, 2).reshape(-1, x.shape[1])
    return x.reshape(-1, x.shape[-1])


def candidate_linears(model: nn.Module, layers=None, what: str = "dal.ptq", convs: bool = True) -> list:
    """``(path, module)`` of every ``supported`` layer with an integer weight quantizer that
    quantizes, in registration order; ``layers`` (paths) restricts them. Raises ``ValueError``
    naming the culprit: an uncalibrated weight quantizer, an unknown path, or no such layer."""
    found, uncalibrated = [], []
    for name, mod in model.named_modules():
        if not supported(mod) or (not convs and not isinstance(mod, QLinear)):
            continue
        wq = getattr(mod, "weight_quant", None)
        if wq is None or not wq.fmt.is_integer or wq.state == "off":
            continue
        if not wq.initialized or wq.state == "observe":
            uncalibrated.append(name)
            continue
        found.append((name, mod))
    if layers is not None:
        wanted = list(layers)
        known = {n for n, _ in found}
        missing = [n for n in wanted if n not in known]
        if missing:
            raise ValueError(f"{what}: layers {missing} are not calibrated QLinears / QConv2ds with an integer weight "
                             f"quantizer "
                             f"(known: {sorted(known)[:8]}{' ...' if len(known) > 8 else ''})")
        found = [(n, m) for n, m in found if n in wanted]
        uncalibrated = [n for n in uncalibrated if n in wanted]
    if uncalibrated:
        raise ValueError(f"{what}: the weight quantizer of {', '.join(uncalibrated[:6])}"
                         f"{' ...' if len(uncalibrated) > 6 else ''} has no scale (state observe): run "
                         "dal.calibrate(model, data) first")
    low = [n for n, m in found if m.weight.dtype not in (torch.float32, torch.float64)]
    if low:
        raise ValueError(f"{what}: {', '.join(low[:6])} {'has' if len(low) == 1 else 'have'} a "
                         f"{dict(found)[low[0]].weight.dtype} weight; the solved weight (code - z) * s is written "
                         "exactly only in float32 or float64: model.float() first")
    if not found:
        raise ValueError(f"{what}: {type(model).__name__} has no QLinear (or plain QConv2d) with an integer weight "
                         "quantizer: prepare it with dal.prepare_qat and a recipe that quantizes linear weights to an "
                         "integer format (e.g. int4 per_group), then dal.calibrate")
    return found


def _block_of(model: nn.Module, name: str) -> Optional[str]:
    """The path of the ModuleList entry that holds ``name`` (the innermost one), or None."""
    parts = name.split(".")
    best = None
    mod = model
    for i, p in enumerate(parts[:-1]):
        child = getattr(mod, p, None) if not p.isdigit() or not isinstance(mod, (nn.ModuleList, nn.Sequential)) \
            else mod[int(p)]
        if child is None:
            return best
        if isinstance(mod, nn.ModuleList):
            best = ".".join(parts[:i + 1])
        mod = child
    return best


def input_groups(model: nn.Module, linears: list, data: Iterable, input_fn: Optional[Callable],
                 what: str = "dal.ptq") -> list:
    """The linears grouped by shared input tensor, in execution order on the first batch of
    ``data``; a linear that did not run there raises ``ValueError`` naming it."""
    seen: list = []  # (input tensor, name, module); the tensors are held so no address is reused

    def make_hook(name, mod):
        def hook(_m, args):
            if args and torch.is_tensor(args[0]) and not any(m is mod for _, _, m in seen):
                seen.append((args[0], name, mod))
        return hook

    handles = [m.register_forward_pre_hook(make_hook(n, m)) for n, m in linears]
    try:
        with torch.no_grad(), eval_mode(model):
            for args, kwargs in iter_inputs(data, 1, input_fn=input_fn, desc=what):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    ran = {n for _, n, _ in seen}
    never = [n for n, _ in linears if n not in ran]
    if never:
        raise ValueError(f"{what}: {', '.join(never[:6])} never ran on the first calibration batch; pass layers=[...] "
                         "without them, or data that reaches them")
    groups: list = []
    last = None
    for x, name, mod in seen:
        if last is not None and x is last:
            groups[-1].names.append(name)
            groups[-1].modules.append(mod)
        else:
            groups.append(InputGroup([name], [mod], _block_of(model, name)))
        last = x
    return groups


def stages(groups: list, sequential: str = "block") -> list:
    """Consecutive input groups captured in one pass (see the module docstring)."""
    if sequential not in SEQUENTIAL:
        raise ValueError(f"sequential={sequential!r} is not one of {SEQUENTIAL}")
    out: list = []
    for g in groups:
        prev = out[-1][-1].block if out else None
        # a block's mates, and a head after a block (lm_head after the last decoder layer)
        if sequential == "block" and prev is not None and (g.block == prev or g.block is None):
            out[-1].append(g)
        else:
            out.append([g])
    return out


def capture_hessians(model: nn.Module, stage: list, data: Iterable, num_batches: Optional[int],
                     input_fn: Optional[Callable], dtype=torch.float32, extra: Optional[list] = None) -> None:
    """Set ``g.hessian = 2/N sum x x^T`` (in ``dtype``) for every input group ``g`` of ``stage``
    from one pass over the data; the forward of each batch stops after the stage's last input.
    ``extra``: more hook handles to remove after the pass."""
    sums = {id(g): None for g in stage}
    counts = {id(g): 0 for g in stage}
    last = stage[-1]

    def make_hook(g):
        def hook(mod, args):
            x = args[0]
            iq = mod.input_quant
            if iq is not None and iq.state != "observe":  # the input the weight multiplies
                x = iq(x)
            x = layer_rows(mod, x.detach()).to(dtype)
            s = x.t().matmul(x)
            sums[id(g)] = s if sums[id(g)] is None else sums[id(g)].add_(s)
            counts[id(g)] += x.shape[0]
            if g is last:
                raise StopForward
        return hook

    handles = [g.modules[0].register_forward_pre_hook(make_hook(g)) for g in stage] + list(extra or [])
    with eval_mode(model):
        run_hooked(model, handles, data, num_batches, input_fn)
    for g in stage:
        if sums[id(g)] is None:
            raise ValueError(f"dal.ptq: {g.names[0]} never ran on the calibration data")
        g.hessian = sums[id(g)].mul_(2.0 / counts[id(g)])
        g.rows = counts[id(g)]


@contextlib.contextmanager
def _solved_off(mods: list):
    """Weight quantizers of solved layers ``off`` for the block (their weights are on the grid, so
    the forward is the same without their fake quantization), ``frozen`` again after it. Not for a
    layer with an int32-quantized bias: its bias scale needs the active weight quantizer."""
    mods = [m for m in mods if m.bias is None or m.weight_quant.granularity.block_size]
    for m in mods:
        m.weight_quant.set_state("off")
    try:
        yield
    finally:
        for m in mods:
            m.weight_quant.set_state("frozen")


def weight_error(delta: torch.Tensor, H: torch.Tensor) -> float:
    """``sum_rows delta H delta^T`` = ``2/N ||X delta^T||^2``: the layer's output error of a weight change."""
    return float((delta.matmul(H) * delta).sum())


@torch.no_grad()
def solve_layerwise(model: nn.Module, data: Iterable, num_batches: Optional[int], *, solve: Callable,
                    input_fn: Optional[Callable] = None, layers=None, sequential: str = "block",
                    replay: bool = True, dtype=torch.float32, progress: bool = False, what: str = "dal.ptq",
                    convs: bool = True) -> dict:
    """Capture the Hessians stage by stage and call ``solve(W, H, quantizers, rows, masks)`` for
    every set of stacked weights (``quantizers``: their weight quantizers, ``rows``: rows each,
    ``masks``: their current ``weight_mask`` or None); it returns ``(grid, result)`` with
    ``result["codes"]`` and optionally ``result["mask"]``. The codes are written back so that
    every layer's fake-quant weight is exactly ``(code - z) * s``, and its weight quantizer is
    left ``frozen`` (QAT after it trains the weights against the solver's scales).

    The calibration batches are materialised once (every pass sees the same batches in the same
    order). ``convs=False``: linears only. ``replay`` (block stages of chained blocks,
    ``dal.ptq.replay``): a pass runs only the last solved block and the current one; the blocks
    before are replayed from recorded outputs.

    Returns ``{"layers": {path: {"error": e, "rtn_error": e0, "tokens": N}}, "passes": passes,
    "replayed": passes that replayed blocks}``, with ``e`` the layer output error
    ``2/N ||X W^T - X Q^T||^2`` of the written weight and ``e0`` that of the calibrated
    round-to-nearest weight, both against the float weight before the step."""
    from tqdm.auto import tqdm

    from ..calibration.batches import cached_inputs
    from .column_grid import grid_key

    batches = cached_inputs(data, num_batches, input_fn=input_fn, desc=what)
    data, num_batches, input_fn = batches, None, (lambda b: b)
    linears = candidate_linears(model, layers, what, convs)
    groups = input_groups(model, linears, data, input_fn, what)
    plan = stages(groups, sequential)
    report: dict = {"layers": {}, "passes": len(plan), "replayed": 0}
    solved: list = []
    chained: dict = {}
    cache = None  # (ModuleList, index c, outputs of block c per batch)
    with eval_mode(model):  # in training, a tracking weight quantizer would re-derive its scale
        for stage in tqdm(plan, desc=what, disable=not progress, leave=False):
            with contextlib.ExitStack() as ctx:
                ctx.enter_context(_solved_off(solved))
                extra, cache = _replay_setup(model, stage, cache, replay and sequential == "block", chained,
                                             data, input_fn, ctx, report)
                capture_hessians(model, stage, data, num_batches, input_fn, dtype, extra)
            for g in stage:
                H = g.hessian
                by_key: dict = {}
                for name, mod in zip(g.names, g.modules):
                    by_key.setdefault(grid_key(mod.weight_quant), []).append((name, mod))
                for members in by_key.values():
                    _solve_stack(members, H, g.rows, solve, report)
                solved.extend(g.modules)
                g.hessian = None  # one stage's Hessians at a time
    return report


def _replay_setup(model, stage, cache, enabled, chained, data, input_fn, ctx, report):
    """For a stage on block ``b`` of a chained ModuleList: replay blocks ``0 .. b-2`` from
    ``cache`` when it holds block ``b-2``'s outputs, and record block ``b-1``'s outputs for the
    next stage. Returns ``(hook handles, the next cache)``."""
    from .replay import chains, record_outputs, replayed

    block = stage[0].block
    if not enabled or block is None:
        return [], None
    parent_path, _, idx = block.rpartition(".")
    blocks = model.get_submodule(parent_path)
    if parent_path not in chained:
        chained[parent_path] = chains(model, blocks, data, input_fn)
    b = int(idx)
    if not chained[parent_path] or b < 1:
        return [], None
    if cache is not None and cache[0] is blocks and cache[1] == b - 2:
        ctx.enter_context(replayed(blocks, b - 2, cache[2]))
        report["replayed"] += 1
    outputs: list = []
    return [record_outputs(blocks[b - 1], outputs)], (blocks, b - 1, outputs)


def _solve_stack(members: list, H: torch.Tensor, tokens: int, solve: Callable, report: dict) -> None:
    mods = [m for _, m in members]
    flat = lambda m, t: t.detach().reshape(m.weight.shape[0], -1).cpu()  # noqa: E731  (conv: out x in*kh*kw)
    W = torch.cat([flat(m, m.weight).to(H.dtype) for m in mods], dim=0)
    masks = [getattr(m, "weight_mask", None) for m in mods]
    mask = None
    if any(k is not None for k in masks):
        mask = torch.cat([flat(m, k if k is not None else torch.ones_like(m.weight, dtype=torch.bool))
                          for k, m in zip(masks, mods)], dim=0)
    rtn = torch.cat([flat(m, m.quantized_weight(m.weight)).to(H.dtype) for m in mods], dim=0)
    try:
        grid, result = solve(W, H.cpu(), [m.weight_quant for m in mods], [m.weight.shape[0] for m in mods], mask)
    except ValueError as err:
        if str(err).startswith(("sparsegpt:", "dal.ptq")):  # names the layers already
            raise
        raise ValueError(f"dal.ptq: {', '.join(n for n, _ in members)}: {err}") from err
    Q = grid.dequantize(result["codes"])
    new_mask = result.get("mask")
    params = grid.split()
    r0 = 0
    for (name, mod), (s, z) in zip(members, params):
        n = mod.weight.shape[0]
        wq = mod.weight_quant
        if grid.group:
            wq.set_qparams(s.to(wq.scale.device), z.to(wq.scale.device))
        q = Q[r0:r0 + n].reshape(mod.weight.shape).to(mod.weight.device, mod.weight.dtype)
        if new_mask is not None:
            keep = new_mask[r0:r0 + n].reshape(mod.weight.shape).to(mod.weight.device)
            if getattr(mod, "weight_mask", None) is None:
                mod.register_buffer("weight_mask", keep.clone())
            else:
                mod.weight_mask.copy_(keep)  # in place: a dal.sparsity controller holds this tensor
            if getattr(mod, "weight_sparsity_stats", None) is None:
                mod.register_buffer("weight_sparsity_stats", torch.zeros(3, dtype=torch.float64, device=keep.device))
            w0 = W[r0:r0 + n]
            mod.weight_sparsity_stats[1] = w0.abs().sum(dtype=torch.float64)
            mod.weight_sparsity_stats[2] = w0.masked_fill(~keep.cpu().reshape(n, -1), 0).abs().sum(dtype=torch.float64)
        mod.weight.copy_(q)
        wq.set_state("frozen")  # the scales stay the solver's: a tracking observer would re-derive them
        got = mod.quantized_weight(mod.weight)
        if not torch.equal(got, q):
            bad = int((got != q).sum())
            raise RuntimeError(f"dal.ptq: {name}: the fake-quant weight differs from the solved weight in {bad} "
                               "element(s); the weight quantizer does not reproduce (code - z) * s")
        if result.get("latent") is not None:  # the weights before rounding: the same fake-quant weight, off the grid
            lat = result["latent"][r0:r0 + n].reshape(mod.weight.shape).to(mod.weight.device, mod.weight.dtype)
            # elementwise on frozen scales: where the kernel rounds a value (a tie) otherwise, the grid point itself
            mod.weight.copy_(torch.where(mod.quantized_weight(lat) == q, lat, q))
            if not torch.equal(mod.quantized_weight(mod.weight), q):
                raise RuntimeError(f"dal.ptq: {name}: the latent weights do not fake-quantize to the solved weight")
        rows = slice(r0, r0 + n)
        report["layers"][name] = {"error": weight_error(W[rows] - Q[rows].to(H.dtype), H),
                                  "rtn_error": weight_error(W[rows] - rtn[rows], H), "tokens": tokens}
        r0 += n
