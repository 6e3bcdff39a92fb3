"""Per-layer sensitivity of a float model to each candidate format: Fisher or output error.

A candidate ``c`` perturbs layer ``l``'s weight ``W`` (per-output-channel symmetric, with an
optional 2:4 magnitude mask first) and its input ``X`` (per-tensor affine, or an FP16 cast):
``dW = Q_c(W) - W``, ``dX = Q_c(X) - X``. Both scores are measured on the float model with
every other layer in float, so they add up across layers (the solver's assumption).

- ``fisher`` (gradient): the second-order estimate of the loss increase with the empirical
  Fisher diagonal, ``s = 1/2 * sum_i E[g_i^2] dW_i^2 + 1/2 * E[sum_j g_j^2 dX_j^2]`` (``g`` the
  loss gradient of the weight / layer input). **Cost:** one forward and one backward pass per
  calibration batch for all layers together, then one quantization of each weight and stored
  input per candidate: ``B`` passes, whatever the number of layers and candidates. The loss is
  ``loss_fn(output, target)`` (cross-entropy when the batches carry integer labels), else the
  cross-entropy against the model's own float predictions.
- ``output_error``: ``s = E ||f_c(X) - f(X)||^2 / E ||f(X)||^2`` with only layer ``l`` in
  candidate ``c``. **Cost:** one forward per batch per (layer, candidate): ``B * L * C`` passes.

A BatchNorm after a conv scales each output channel; per-channel symmetric quantization commutes
with that scale, so scoring the unfolded conv weight gives the folded one's error.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import FP16


def quantize_weight(w: torch.Tensor, fmt, sparse: bool) -> torch.Tensor:
    """The candidate's weight: 2:4 magnitude mask along the input axis, then per-channel symmetric."""
    if sparse:
        moved = w.movedim(1, -1)
        groups = moved.reshape(-1, 4)
        keep = groups.abs().topk(2, dim=-1).indices
        mask = torch.zeros_like(groups).scatter_(-1, keep, 1.0)
        w = (groups * mask).reshape(moved.shape).movedim(-1, 1)
    if not fmt.is_scaled:
        return w.to(torch.float16).to(w.dtype) if fmt == FP16 else w
    qmax = fmt.qmax
    amax = w.abs().reshape(w.shape[0], -1).amax(1).clamp_min(1e-12)
    scale = (amax / qmax).reshape(-1, *([1] * (w.dim() - 1)))
    if fmt.is_float8:
        return _fp8(w / scale, fmt) * scale
    return torch.clamp(torch.round(w / scale), fmt.qmin, fmt.qmax) * scale


def _fp8(x: torch.Tensor, fmt) -> torch.Tensor:
    dtype = torch.float8_e4m3fn if fmt.name == "fp8_e4m3" else torch.float8_e5m2
    return torch.clamp(x, fmt.qmin, fmt.qmax).to(dtype).to(x.dtype)


def quantize_input(x: torch.Tensor, fmt) -> torch.Tensor:
    """The candidate's input: per-tensor affine over the batch's range (integers), or a cast."""
    if not fmt.is_scaled:
        return x.to(torch.float16).to(x.dtype) if fmt == FP16 else x
    if fmt.is_float8:
        scale = x.abs().amax().clamp_min(1e-12) / fmt.qmax
        return _fp8(x / scale, fmt) * scale
    lo, hi = torch.clamp(x.amin(), max=0.0), torch.clamp(x.amax(), min=0.0)
    scale = ((hi - lo) / (fmt.qmax - fmt.qmin)).clamp_min(1e-12)
    zp = torch.round(fmt.qmin - lo / scale)
    return (torch.clamp(torch.round(x / scale) + zp, fmt.qmin, fmt.qmax) - zp) * scale


def _split(batch):
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and torch.is_tensor(batch[0]):
        return batch[0], batch[1]
    return (batch if torch.is_tensor(batch) else batch[0]), None


def _loss(out, target, loss_fn, ref):
    if loss_fn is not None:
        return loss_fn(out, target)
    if target is not None and not target.is_floating_point():
        return F.cross_entropy(out, target)
    return F.cross_entropy(out, ref.softmax(-1))


def fisher_scores(model: nn.Module, batches, layers: dict, loss_fn=None) -> dict:
    """name -> {candidate key: score} (see the module docstring); ``layers``: name -> candidates,
    each candidate a (key, weight format, input format, sparse) tuple."""
    mods = {n: model.get_submodule(n) for n in layers}
    grad_w = {n: torch.zeros_like(m.weight) for n, m in mods.items()}
    act = {n: {k: 0.0 for k, *_ in cands} for n, cands in layers.items()}
    seen: dict = {}
    handles = []

    def keep(name):
        def hook(mod, args):
            x = args[0]
            if x.requires_grad:
                x.retain_grad()
            seen[name] = x
        return hook

    frozen = [m.weight for m in mods.values() if not m.weight.requires_grad]
    for w in frozen:  # a frozen (requires_grad=False) weight still needs its gradient here
        w.requires_grad_(True)
    for n, m in mods.items():
        handles.append(m.register_forward_pre_hook(keep(n)))
    try:
        with _eval(model):
            for batch in batches:
                x, y = _split(batch)
                x = x.clone().requires_grad_(True)
                model.zero_grad(set_to_none=True)
                out = model(x)
                _loss(out, y, loss_fn, out.detach()).backward()
                for n, m in mods.items():
                    grad_w[n] += m.weight.grad.detach() ** 2
                    inp, g = seen[n].detach(), seen[n].grad
                    if g is None:
                        continue
                    for key, _, afmt, _ in layers[n]:
                        act[n][key] += float(((g * (quantize_input(inp, afmt) - inp)) ** 2).sum())
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        for w in frozen:
            w.requires_grad_(False)
    count = max(len(batches), 1)
    out = {}
    for n, cands in layers.items():
        w = mods[n].weight.detach()
        fisher = grad_w[n] / count
        out[n] = {key: 0.5 * float((fisher * (quantize_weight(w, wfmt, sp) - w) ** 2).sum()) + 0.5 * act[n][key] / count
                  for key, wfmt, _, sp in cands}
    return out


@contextlib.contextmanager
def _eval(model):
    from ..nn.modes import eval_mode

    with eval_mode(model):
        yield


@contextlib.contextmanager
def _candidate(mod: nn.Module, wfmt, afmt, sparse):
    saved = mod.weight.data.clone()
    mod.weight.data = quantize_weight(saved, wfmt, sparse)
    h = mod.register_forward_pre_hook(lambda m, args: (quantize_input(args[0], afmt),) + tuple(args[1:]))
    try:
        yield
    finally:
        h.remove()
        mod.weight.data = saved


def output_error_scores(model: nn.Module, batches, layers: dict) -> dict:
    """name -> {candidate key: relative output MSE} (see the module docstring)."""
    inputs = [_split(b)[0] for b in batches]
    out = {}
    with _eval(model), torch.no_grad():
        refs = [model(x) for x in inputs]
        power = sum(float((r ** 2).sum()) for r in refs) or 1.0
        for n, cands in layers.items():
            mod = model.get_submodule(n)
            out[n] = {}
            for key, wfmt, afmt, sp in cands:
                with _candidate(mod, wfmt, afmt, sp):
                    err = sum(float(((model(x) - r) ** 2).sum()) for x, r in zip(inputs, refs))
                out[n][key] = err / power
    return out
