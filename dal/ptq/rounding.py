"""AdaRound: learned rounding of weights (Nagel et al., "Up or Down? Adaptive Rounding for
Post-Training Quantization", ICML 2020).

Each weight is rounded down or up, the choice learned per element against the float layer's
output on calibration data. With ``s``, ``z`` the weight quantizer's scale and zero point:

    W_soft = s * (clip(floor(W / s) + h(V), qmin - z, qmax - z))
    h(V)   = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)        zeta = 1.1, gamma = -0.1
    loss   = E || f(op(x_q, W_soft) + b) - f(op(x_f, W) + b) ||^2_channels + lam * sum(1 - |2 h(V) - 1|^beta)

``x_q`` is the layer's input in the quantized model (the layers before it already rounded),
``x_f`` the float model's, ``f`` the layer's fused activation (ReLU / ReLU6 / none). ``beta``
anneals from 20 to 2 after a warm-up (20% of the iterations, regulariser off), which pushes every
``h(V)`` to 0 or 1. ``V`` starts where ``h(V) = W / s - floor(W / s)`` (W_soft = W). At the end
``h`` is hardened (``h >= 0.5``; a layer whose hardened rounding reconstructs worse than
round-to-nearest, which too few ``iters`` can cause, keeps round-to-nearest) and the layer's weight becomes exactly ``s * (code - z)``: the
weight quantizer (frozen, scale unchanged) gives back ``code`` and the exporter writes it, so
the ONNX file still carries plain QuantizeLinear / DequantizeLinear.

Layer by layer (``block="layer"``), in execution order; ``block="block"`` learns the layers of a
block jointly against the float block output (BRECQ, ``block_rounding.py``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..nn.base import apply_activation
from ..quantizer import quantizer_states
from .layers import capture_inputs, float_weight, linear_op, pre_activation, set_float_weight, weighted_layers

ZETA, GAMMA = 1.1, -0.1


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    """h(V) = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)."""
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def round_regularizer(h: torch.Tensor, beta: float) -> torch.Tensor:
    """sum(1 - |2 h - 1|^beta): 0 exactly when every h is 0 or 1."""
    return (1.0 - (2.0 * h - 1.0).abs().pow(beta)).sum()


def beta_at(step: int, iters: int, warmup: float = 0.2, start: float = 20.0, end: float = 2.0) -> Optional[float]:
    """Annealed beta (linear from ``start`` to ``end`` after ``warmup``); None during warm-up."""
    first = int(warmup * iters)
    if step < first:
        return None
    t = (step - first) / max(iters - first, 1)
    return end + (start - end) * (1.0 - t)


def initial_rounding(w: torch.Tensor, s: torch.Tensor) -> tuple:
    """``(floor(W / s), exact, V)``: the grid point below each weight, where W is on the grid
    already (one rounding only), and the V at which ``h(V) = W / s - floor(W / s)`` (W_soft = W)."""
    # w / s in float64: a float32 quotient can land exactly on an integer k that the true
    # quotient misses by 1e-7, and k + 1 would then be neither its floor nor its ceiling.
    ratio = w.double() / s.double()
    floor = torch.floor(ratio)
    exact = ratio == floor
    rest = (ratio - floor).float().clamp(0.01, 0.99)
    return floor.float(), exact, nn.Parameter(-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1.0))


@dataclass
class AdaRoundReport:
    """Per layer: reconstruction loss before / after (MSE of the layer output), the fraction of
    weights rounded differently from round-to-nearest, and the final regulariser value."""

    rows: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = ["dal.ptq.adaround: layer, mse nearest -> learned, flipped vs nearest"]
        lines += [f"  {r['layer']}: {r['mse_nearest']:.4e} -> {r['mse_learned']:.4e}, {100 * r['flipped']:.2f}%"
                  for r in self.rows]
        return "\n".join(lines)


def weight_grid(mod):
    """``(W, s, z, qmin, qmax)`` of ``mod``'s weight quantizer, ``s`` and ``z`` broadcast to W's shape."""
    wq = mod.weight_quant
    w = float_weight(mod).detach()
    s, z = wq.effective_qparams()
    s = wq.granularity.expand(s.float(), w.shape)
    z = wq.granularity.expand(z.float(), w.shape)
    return w, s, z, float(wq.qmin), float(wq.qmax)


def _optimize_layer(mod, xq, target, bias, iters, lr, lam, batch_size, gen):
    w, s, z, qmin, qmax = weight_grid(mod)
    floor, exact, v = initial_rounding(w, s)
    keep = (~exact).float()
    opt = torch.optim.Adam([v], lr=lr)
    n = xq.shape[0]
    act = getattr(mod, "activation", None)
    iq = mod.input_quant
    with torch.no_grad():
        xin = iq(xq) if iq is not None else xq

    def out(wt, idx):
        return apply_activation(_add_bias(mod, linear_op(mod, xin[idx], wt), bias), act)

    with torch.enable_grad():  # a caller's torch.no_grad() must not silently stop the learning
        for step in range(iters):
            idx = torch.randint(0, n, (min(batch_size, n),), generator=gen)
            h = rectified_sigmoid(v) * keep
            w_soft = s * (torch.clamp(floor + h, qmin - z, qmax - z))
            # Squared error summed over output channels, averaged over samples and positions (the
            # scale AIMET's defaults, lam = 0.01 with a summed regulariser, are tuned for).
            loss = (out(w_soft, idx) - target[idx]).pow(2).sum(1).mean()
            beta = beta_at(step, iters)
            if beta is not None:
                loss = loss + lam * round_regularizer(h, beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        h = torch.where(exact, torch.zeros_like(v), rectified_sigmoid(v))
        codes = torch.clamp(floor + (h >= 0.5).float(), qmin - z, qmax - z) + z
        nearest = torch.clamp(torch.round(w / s) + z, qmin, qmax)
        all_idx = torch.arange(n)
        mse_near = float((out(s * (nearest - z), all_idx) - target).pow(2).mean())
        mse_learn = float((out(s * (codes - z), all_idx) - target).pow(2).mean())
        reg = float(round_regularizer(h, 2.0)) / h.numel()
        if mse_learn > mse_near:
            # Too few iterations for this layer: keep round-to-nearest rather than a worse rounding.
            codes, mse_learn = nearest, mse_near
    return codes, s, z, {"mse_nearest": mse_near, "mse_learned": mse_learn,
                         "flipped": float((codes != nearest).float().mean()), "regularizer": reg,
                         "h": h.detach()}


def adaround(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *, iters: int = 500,
             lr: float = 0.1, lam: float = 0.01, batch_size: int = 32, layers: Optional[list] = None,
             input_fn: Optional[Callable] = None, progress: bool = True, seed: int = 0, block: str = "layer",
             blocks: Optional[list] = None, max_block_layers: int = 4) -> AdaRoundReport:
    """Learn the rounding of every calibrated integer weight of a prepared ``model`` in place
    (see the module docstring for the formula). The model must be calibrated (scales set).

    Args:
        data: calibration batches (a few hundred samples); ``num_batches`` of them are used.
        iters: Adam steps per layer; ``lr``: their learning rate (0.1: the paper's 1e-3 needs
            its 10k steps to move V past the saturation of h; a few hundred steps need more);
            ``lam``: regulariser weight.
        batch_size: samples (conv: images) per step, drawn from the cached layer inputs.
        layers: restrict to these layer paths (default: every active integer-weight layer).
        block: ``"layer"`` (each layer against its own float output) or ``"block"`` (BRECQ:
            the layers of each block against the float block output; ``dal.ptq.block_rounding``).
        blocks, max_block_layers: with ``block="block"``, the block paths (default: found by
            ``block_rounding.find_blocks``: submodules holding 2..``max_block_layers`` layers).

    Afterwards every weight is ``s * (code - z)`` with ``code`` in ``{floor(W/s), floor(W/s)+1}
    + z`` (clipped to the format), and the weight quantizers are ``frozen`` (their scale is kept).

    Example:
        >>> dal.calibrate(qmodel, calib); rep = dal.ptq.adaround(qmodel, calib)   # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    chosen = [(n, m) for n, m in weighted_layers(model, data, input_fn) if layers is None or n in set(layers)]
    if layers is not None and len(chosen) != len(set(layers)):
        known = [n for n, _ in weighted_layers(model)]
        raise ValueError(f"adaround: {sorted(set(layers) - {n for n, _ in chosen})} are not calibrated "
                         f"integer-weight layers; known: {known}")
    if block not in ("layer", "block"):
        raise ValueError(f"adaround: block={block!r}; use 'layer' or 'block'")
    if block == "block":
        from .block_rounding import block_adaround

        return block_adaround(model, data, chosen, num_batches, iters=iters, lr=lr, lam=lam, batch_size=batch_size,
                              blocks=blocks, max_layers=max_block_layers, input_fn=input_fn, progress=progress,
                              seed=seed)
    pristine = copy.deepcopy(model)
    float_mods = dict(pristine.named_modules())
    gen = torch.Generator().manual_seed(seed)
    report = AdaRoundReport()
    was_training = model.training
    model.eval()
    pristine.eval()
    try:
        for name, mod in tqdm(chosen, desc="dal.ptq.adaround", disable=not progress, leave=False):
            fmod = float_mods[name]
            xq = torch.cat(capture_inputs(model, mod, data, num_batches, input_fn))
            with quantizer_states(pristine, "off"), torch.no_grad():
                xf = torch.cat(capture_inputs(pristine, fmod, data, num_batches, input_fn))
                bias = _float_bias(fmod)
                target = apply_activation(_add_bias(fmod, pre_activation(fmod, xf), bias),
                                          getattr(fmod, "activation", None))
            with quantizer_states(model):
                codes, s, z, row = _optimize_layer(mod, xq, target, bias, iters, lr, lam, batch_size, gen)
            set_float_weight(mod, s * (codes - z))
            mod.weight_quant.set_state("frozen")
            report.rows.append({"layer": name, **row})
            del xq, xf, target
    finally:
        model.train(was_training)
    return report


def _float_bias(mod):
    from ..nn.conv_bn import QConvBn2d

    if isinstance(mod, QConvBn2d):
        return mod.folded_weight_and_bias()[1].detach()
    return None if mod.bias is None else mod.bias.detach()


def _add_bias(mod, y, bias):
    if bias is None:
        return y
    return y + (bias if isinstance(mod, nn.Linear) else bias.reshape((1, -1) + (1,) * (y.dim() - 2)))


def learned_codes(mod: nn.Module) -> torch.Tensor:
    """The integer codes the weight quantizer of ``mod`` produces now: ``round(W / s) + z`` clipped."""
    w, s, z, qmin, qmax = weight_grid(mod)
    return torch.clamp(torch.round(w / s) + z, qmin, qmax)

