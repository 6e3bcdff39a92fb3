"""EasyQuant-style scale search (Wu et al., 2020): per layer, alternately tune weight and
activation scales to maximise the cosine similarity of the layer's output with the float model's.

For each quantized layer ``l`` in execution order, with ``x_l`` its input in the *quantized*
model (earlier layers already tuned, so their error is compensated, not ignored) and ``o_l`` its
output in the float model (every quantizer off) on the same batch:

    S_w <- argmax_{a in grid} cos(l(x_l; a * S_w, S_a), o_l)     per output channel when the
                                                                  weight is per channel
    S_a <- argmax_{a in grid} cos(l(x_l; S_w, a * S_a), o_l)     per activation quantizer

repeated ``rounds`` times, starting from the recipe's calibration (min-max for the bundled
int8 recipes), with ``cos(u, v) = <u, v> / (|u| |v|)`` over the ``search_batches`` cached
batches. Multiplying a scale keeps the zero point, i.e. scales the clipping range about 0.
The grid contains 1.0, so a layer never ends worse than it started. Per channel, channels are
independent (output channel ``c`` depends on weight row ``c`` only), so every channel takes
its own best multiplier from the same ``len(grid)`` forward passes.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..nn.base import QATModule
from ..nn.modes import eval_mode
from ..observers import MinMaxObserver
from ..quantizer import quantizer_states
from .batches import iter_inputs, run_model
from .methods import seed_range
from .observe import observe_ranges


class _Stop(BaseException):
    """Raised from a hook once the wanted tensor is captured (the rest of the forward is wasted);
    a BaseException so that no ``except Exception`` on the way (fx, run_model) wraps it."""


class _Tee:
    """Iterates ``data`` once for the base calibration and keeps the first ``keep`` raw batches."""

    def __init__(self, data, keep: int):
        self.data, self.keep, self.kept = data, keep, []

    def __iter__(self):
        for batch in self.data:
            if len(self.kept) < self.keep:
                self.kept.append(batch)
            yield batch

    def __len__(self):
        return len(self.data)


def _tunable(mod: nn.Module) -> dict:
    """The layer's own quantizers that the search may scale: scaled formats, calibrated, active."""
    found = mod.quantizers() if hasattr(mod, "quantizers") else {}
    return {k: q for k, q in found.items()
            if q.fmt.is_scaled and q.state == "quantize" and q.initialized}


def _layers_in_order(model: nn.Module, inputs) -> list[tuple[str, nn.Module]]:
    order, hooks = [], []
    for name, mod in model.named_modules():
        if name and isinstance(mod, QATModule) and _tunable(mod):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: order.append((name, m)) if all(n != name for n, _ in order) else None))
    try:
        with torch.no_grad():
            args, kwargs = inputs[0]
            run_model(model, args, kwargs)
    finally:
        for h in hooks:
            h.remove()
    return order


def _capture(model: nn.Module, mod: nn.Module, inputs, output: bool) -> list:
    """Per batch: ``mod``'s first (args, kwargs) call, or its output, in ``model``'s forward."""
    got = []

    def pre(m, args, kwargs):
        got.append((tuple(a.detach() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
        raise _Stop

    def post(m, args, kwargs, out):
        got.append(out.detach().clone())
        raise _Stop

    h = mod.register_forward_hook(post, with_kwargs=True) if output else \
        mod.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            for i, (args, kwargs) in enumerate(inputs):
                n = len(got)
                try:
                    run_model(model, args, kwargs, i)
                except _Stop:
                    pass
                if len(got) == n:
                    raise RuntimeError(f"easyquant: layer {getattr(mod, 'qat_name', '?')} did not run on batch {i}")
    finally:
        h.remove()
    return got


class _Cos:
    """Streaming cosine per channel (``dim``) or over the whole tensor (``dim=None``)."""

    def __init__(self, dim: Optional[int]):
        self.dim, self.dot, self.nu, self.nv = dim, 0.0, 0.0, 0.0

    def add(self, u: torch.Tensor, v: torch.Tensor) -> None:
        # float32 products, float64 accumulation across batches: the search compares candidates
        # on the same data, so the sums only need to rank them, not be exact.
        u, v = u.float(), v.float()
        if self.dim is None:
            dims = tuple(range(u.dim()))
        else:
            d = self.dim % u.dim()
            dims = tuple(i for i in range(u.dim()) if i != d)
        self.dot = self.dot + (u * v).sum(dims).double()
        self.nu = self.nu + (u * u).sum(dims).double()
        self.nv = self.nv + (v * v).sum(dims).double()

    def value(self) -> torch.Tensor:
        return self.dot / torch.sqrt(self.nu * self.nv).clamp_min(1e-300)


def _search(mod, q, base: torch.Tensor, grid, xs, targets, channel_dim: Optional[int]) -> torch.Tensor:
    """Best multiplier for ``q``'s scale (per channel when ``channel_dim`` is given)."""
    best_val, best_alpha = None, None
    with torch.no_grad():
        for a in grid:
            q.scale.data.copy_(base * a)
            cos = _Cos(channel_dim)
            for (args, kwargs), t in zip(xs, targets):
                cos.add(mod(*args, **kwargs), t)
            val = torch.nan_to_num(cos.value(), nan=-2.0)
            if best_val is None:
                best_val = val.clone()
                best_alpha = torch.full_like(val, a)
            else:
                better = val > best_val
                best_val = torch.where(better, val, best_val)
                best_alpha = torch.where(better, torch.full_like(val, a), best_alpha)
    return best_alpha


def _channel_dim(mod, key: str, q) -> Optional[int]:
    """Output dimension indexed by the weight's per-channel scales, or None (one multiplier)."""
    if key != "weight_quant" or q.granularity.axis is None or q.granularity.block_size:
        return None
    if q.granularity.axis != getattr(mod, "weight_channel_axis", 0) or q.scale.numel() <= 1:
        return None
    if isinstance(mod, nn.Linear):
        return -1
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)) and getattr(mod, "groups", 1) == 1:
        return 1
    return None


def easyquant(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *,
              input_fn: Optional[Callable] = None, progress: bool = True, search_batches: int = 2,
              grid=(0.5, 1.2, 11), rounds: int = 2) -> nn.Module:
    """Recipe calibration, then the alternating per-layer search of the module docstring.

    Args:
        search_batches: how many of the calibration batches the search runs on (cached in memory
            together with every layer's float output on them).
        grid: ``(low, high, points)`` of the scale multipliers tried (1.0 is always added).
        rounds: weight / activation alternations per layer.
    """
    if search_batches < 1 or rounds < 1:
        raise ValueError(f"easyquant: search_batches={search_batches} and rounds={rounds} must be >= 1")
    lo, hi, points = grid
    alphas = sorted(set(torch.linspace(float(lo), float(hi), int(points)).tolist()) | {1.0})
    tee = _Tee(data, search_batches)
    observe_ranges(model, tee, num_batches, input_fn=input_fn, progress=progress)
    xs_model = list(iter_inputs(tee.kept, None, input_fn=input_fn, desc="easyquant"))
    with eval_mode(model):
        _search_all(model, xs_model, alphas, rounds, progress)
    return model


def _search_all(model, xs_model, alphas, rounds: int, progress: bool) -> None:
    from tqdm.auto import tqdm

    layers = _layers_in_order(model, xs_model)
    with quantizer_states(model, "off"):
        float_out = {name: _capture(model, mod, xs_model, output=True) for name, mod in layers}
    for name, mod in tqdm(layers, desc="dal.calibrate easyquant", disable=not progress, leave=False):
        xs = _capture(model, mod, xs_model, output=False)
        targets = float_out.pop(name)
        tunable = _tunable(mod)
        bases = {k: q.scale.detach().clone() for k, q in tunable.items()}
        alpha = {k: torch.ones_like(b) for k, b in bases.items()}
        weights = [k for k in tunable if k == "weight_quant"]
        acts = [k for k in tunable if k != "weight_quant"]
        for r in range(rounds):
            changed = False
            for k in weights + acts:
                q = tunable[k]
                dim = _channel_dim(mod, k, q)
                best = _search(mod, q, bases[k], alphas, xs, targets, dim)
                best = best.reshape(bases[k].shape) if dim is not None else best.expand_as(bases[k]).clone()
                changed = changed or not torch.equal(best.to(alpha[k].dtype), alpha[k])
                alpha[k] = best.to(alpha[k].dtype)
                q.scale.data.copy_(bases[k] * alpha[k])
            if not changed or len(tunable) == 1:
                break  # a fixed point: another alternation would repeat the same searches
        for k, q in tunable.items():
            _commit(q, alpha[k])


@torch.no_grad()
def _commit(q, alpha: torch.Tensor) -> None:
    """Make the searched scale the quantizer's, and its min-max observer's range agree with it
    (so QAT's observer updates continue from the searched range instead of undoing it)."""
    obs = q.observer
    if isinstance(obs, MinMaxObserver) and isinstance(getattr(obs, "min_val", None), torch.Tensor) and obs.min_val.shape == alpha.shape:
        seed_range(obs, obs.min_val * alpha, obs.max_val * alpha, int(obs.batches_seen))
        q.compute_qparams()
