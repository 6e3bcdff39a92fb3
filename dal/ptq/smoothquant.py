"""SmoothQuant-style scale migration for linear layers fed by LayerNorm (Xiao et al.,
"SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language Models",
ICML 2023).

Transformer activations after LayerNorm have a few channels with outliers, which a per-tensor
static activation scale cannot serve. Per input channel ``j`` of the linears the LayerNorm feeds:

    s_j = max|X_j|^alpha / max|W[:, j]|^(1 - alpha)          (alpha = 0.5; W: all those linears)
    LN.weight_j /= s_j,  LN.bias_j /= s_j,   W[:, j] *= s_j

``X`` is the LayerNorm's output on calibration data. ``X diag(1/s) (diag(s) W^T) = X W^T``, and
the division folds into LayerNorm's affine parameters, so the float function is unchanged and
no new operator appears in the exported graph. Apply to the float model before ``prepare_qat``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..calibration.batches import iter_inputs
from .fold_bn import traced


def layernorm_linear_groups(model: nn.Module) -> list[tuple[str, list]]:
    """``(layernorm path, [linear paths])`` where every user of the LayerNorm, at every call of
    it (a module called twice is one set of parameters), is an nn.Linear."""
    gm = traced(model)
    mods = dict(model.named_modules())
    users: dict = {}
    bad: set = set()
    for node in gm.graph.nodes:
        ln = mods.get(node.target) if node.op == "call_module" else None
        if not isinstance(ln, nn.LayerNorm) or not ln.elementwise_affine or len(ln.normalized_shape) != 1:
            continue
        found = list(node.users)
        if not found or not all(u.op == "call_module" and isinstance(mods.get(u.target), nn.Linear)
                                and u.args[0] is node for u in found):
            bad.add(node.target)
        users.setdefault(node.target, []).extend(u.target for u in found if u.target not in users[node.target])
    return [(name, linears) for name, linears in users.items() if name not in bad]


def smooth_quant(model: nn.Module, data: Iterable, num_batches: Optional[int] = 8, alpha: float = 0.5, *,
                 input_fn: Optional[Callable] = None, progress: bool = True) -> dict:
    """Migrate activation outliers into the weights for every LayerNorm -> Linear group of float
    ``model``, in place (module docstring). Returns ``{layernorm path: s}``.

    Example:
        >>> dal.ptq.smooth_quant(vit_block, calib, alpha=0.5)   # doctest: +SKIP
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_quant: alpha={alpha} must lie in [0, 1]")
    groups = layernorm_linear_groups(model)
    mods = dict(model.named_modules())
    amax: dict = {}

    def make_hook(name):
        def hook(_m, _args, out):
            m = out.detach().abs().reshape(-1, out.shape[-1]).amax(0)
            amax[name] = torch.maximum(amax[name], m) if name in amax else m
        return hook

    handles = [mods[ln].register_forward_hook(make_hook(ln)) for ln, _ in groups]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for args, kwargs in iter_inputs(data, num_batches, input_fn=input_fn, progress=progress,
                                            desc="dal.ptq.smooth_quant"):
                model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    scales = {}
    with torch.no_grad():
        for ln_name, linears in groups:
            if ln_name not in amax:
                continue
            wmax = torch.stack([mods[n].weight.abs().amax(0) for n in linears]).amax(0)
            s = amax[ln_name].clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1.0 - alpha)
            s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
            ln = mods[ln_name]
            ln.weight.div_(s)
            if ln.bias is not None:
                ln.bias.div_(s)
            for n in linears:
                mods[n].weight.mul_(s)
            scales[ln_name] = s
    return scales
