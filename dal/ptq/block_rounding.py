"""Block-wise AdaRound: the rounding of every layer of a block learned jointly against the float
block's output (BRECQ: Li et al., "BRECQ: Pushing the Limit of Post-Training Quantization by
Block Reconstruction", ICLR 2021).

Layer-wise AdaRound (``rounding.py``) fits each layer to its own float output, so it cannot see
that the next layer of the block would undo an error. Here a *block* ``B`` (a residual block, a
depthwise + pointwise pair: any submodule holding a few weighted layers) is fitted as a whole:

    loss = E || B_q(x_q; W_soft_1 .. W_soft_k) - B_f(x_f) ||^2_channels + lam * sum_l sum(1 - |2 h(V_l) - 1|^beta)

``B_q`` is the block in the quantized model with its activation / input quantizers on, fed the
input ``x_q`` it receives there (every block before it already rounded); ``B_f`` is the float
block on the float model's input ``x_f``. ``W_soft_l = s_l * clip(floor(W_l / s_l) + h(V_l), ...)``
and the annealed regulariser are those of ``rounding.py`` (Nagel et al. 2020), one ``V`` per
layer, all optimised by one Adam. BRECQ weighs the squared error with the diagonal Fisher
information of the block output (squared gradients of the task loss); this is the unweighted
form, which needs no labels. At the end each ``h`` is hardened (``h >= 0.5``); a block whose
hardened rounding reconstructs worse than round-to-nearest keeps round-to-nearest. Every weight
then is exactly ``s * (code - z)`` and its quantizer ``frozen``, as after layer-wise AdaRound.

Blocks (``find_blocks``): the smallest submodules holding 2 to ``max_layers`` of the chosen
layers, i.e. those none of whose children holds two (torchvision's ResNet: each BasicBlock /
Bottleneck, its downsample included; dal_examples.zoo.MobileNetTiny: each depthwise + pointwise pair); a
chosen layer in no block is fitted alone (its own output, activation included). The block's
``forward`` must be called by its parent with the block input as first argument and return one
tensor.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..quantizer import quantizer_states
from .layers import capture_inputs, set_float_weight, unfolded_weight
from .rounding import AdaRoundReport, beta_at, initial_rounding, rectified_sigmoid, round_regularizer, weight_grid


def find_blocks(model: nn.Module, layer_names: list[str], max_layers: int = 4) -> list[tuple[str, list[str]]]:
    """``(unit path, [layer paths])`` covering ``layer_names`` once each (module doc, "Blocks"),
    in the order of ``layer_names`` (pass them in execution order)."""
    chosen = set(layer_names)
    units: list = []

    def inside(prefix):
        return [n for n in layer_names if not prefix or n == prefix or n.startswith(prefix + ".")]

    def visit(prefix, mod):
        names = inside(prefix)
        if not names:
            return
        if prefix in chosen:
            units.append((prefix, [prefix]))
        elif prefix and 2 <= len(names) <= max_layers and all(
                len(inside(f"{prefix}.{child}")) < 2 for child, _ in mod.named_children()):
            units.append((prefix, names))
        else:
            for child, sub in mod.named_children():
                visit(f"{prefix}.{child}" if prefix else child, sub)

    visit("", model)
    order = {n: i for i, n in enumerate(layer_names)}
    return sorted(units, key=lambda u: min(order[n] for n in u[1]))


class _SoftWeights:
    """The soft-rounded weights of a block's layers. The block runs through
    ``torch.func.functional_call`` with each layer's ``weight`` replaced by the one whose folded
    form is ``W_soft`` and the layers' weight quantizers ``off`` (W_soft is on the grid already,
    softly), so the fit does not depend on how a QAT module applies its weight quantizer. The
    int32 bias quantization, which needs an active weight quantizer, is skipped while fitting."""

    def __init__(self, unit: nn.Module, path: str, mods: dict):
        self.unit, self.mods, self.state, self.current = unit, mods, {}, {}
        self.rel = {n: (n[len(path) + 1:] + ".weight" if n != path else "weight") for n in mods}
        for name, mod in mods.items():
            w, s, z, qmin, qmax = weight_grid(mod)
            floor, exact, v = initial_rounding(w, s)
            self.state[name] = (w, s, z, qmin, qmax, floor, exact, v)

    def params(self) -> list:
        return [st[7] for st in self.state.values()]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.unit, self.current, (x,))

    def soft(self) -> list:
        """Set the soft weights of this step; returns each layer's h(V) (for the regulariser)."""
        hs = []
        for name, (_, s, z, qmin, qmax, floor, exact, v) in self.state.items():
            h = rectified_sigmoid(v) * (~exact).float()
            self._set(name, s * torch.clamp(floor + h, qmin - z, qmax - z))
            hs.append(h)
        return hs

    def _set(self, name, w):
        mod = self.mods[name]
        m = getattr(mod, "weight_mask", None)
        self.current[self.rel[name]] = unfolded_weight(mod, w if m is None else w * m.to(w.dtype))

    def hard(self, learned: bool) -> dict:
        """Per layer ``(codes, s, z, h)``: hardened learned codes, or round-to-nearest."""
        out = {}
        for name, (w, s, z, qmin, qmax, floor, exact, v) in self.state.items():
            h = torch.where(exact, torch.zeros_like(v), rectified_sigmoid(v)).detach()
            if learned:
                codes = torch.clamp(floor + (h >= 0.5).float(), qmin - z, qmax - z) + z
            else:
                codes = torch.clamp(torch.round(w / s) + z, qmin, qmax)
            out[name] = (codes, s, z, h)
        return out

    def set_hard(self, hard: dict) -> None:
        for name, (codes, s, z, _) in hard.items():
            self._set(name, (s * (codes - z)).detach())

    def __enter__(self):
        for mod in self.mods.values():
            mod.weight_quant.set_state("off")
        return self

    def __exit__(self, *exc):
        pass  # the caller's quantizer_states(model) restores the states


def _block_mse(soft: _SoftWeights, xq, target, chunk: int) -> float:
    with torch.no_grad():
        err = sum(float((soft.run(xq[i:i + chunk]) - target[i:i + chunk]).pow(2).sum())
                  for i in range(0, len(xq), chunk))
    return err / target.numel()


def _fit_unit(soft: _SoftWeights, xq, target, iters, lr, lam, batch_size, gen) -> tuple[dict, float, float]:
    opt = torch.optim.Adam(soft.params(), lr=lr)
    n = xq.shape[0]
    with soft, torch.enable_grad():  # a caller's torch.no_grad() must not silently stop the learning
        for step in range(iters):
            idx = torch.randint(0, n, (min(batch_size, n),), generator=gen)
            hs = soft.soft()
            out = soft.run(xq[idx])
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"adaround(block=...): block {type(soft.unit).__name__} "
                                f"returns {type(out).__name__}, not one tensor; name its layers in blocks= instead")
            # Squared error summed over channels (dim 1), averaged over samples and positions.
            loss = (out - target[idx]).pow(2).sum(1).mean()
            beta = beta_at(step, iters)
            if beta is not None:
                loss = loss + lam * sum(round_regularizer(h, beta) for h in hs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        chunk = max(4 * batch_size, 1)
        nearest, learned = soft.hard(False), soft.hard(True)
        soft.set_hard(nearest)
        mse_near = _block_mse(soft, xq, target, chunk)
        soft.set_hard(learned)
        mse_learn = _block_mse(soft, xq, target, chunk)
    if mse_learn > mse_near:  # too few iterations for this block: round-to-nearest is better
        return nearest, mse_near, mse_near
    return learned, mse_near, mse_learn


def block_adaround(model: nn.Module, data: Iterable, layers: list[tuple[str, nn.Module]],
                   num_batches: Optional[int] = None, *, iters: int = 500, lr: float = 0.1, lam: float = 0.01,
                   batch_size: int = 32, blocks: Optional[list[str]] = None, max_layers: int = 4,
                   input_fn: Optional[Callable] = None, progress: bool = True, seed: int = 0) -> AdaRoundReport:
    """Block-wise AdaRound of ``layers`` (``(path, module)`` in execution order) of a calibrated
    model, in place (module docstring). ``blocks``: the block paths to fit (each layer inside one
    of them is fitted with its block, the others alone); default ``find_blocks(max_layers)``.
    Called by ``dal.ptq.adaround(..., block="block")``; the report has one row per layer (the
    reconstruction errors are its block's, ``row["block"]`` names the block)."""
    from tqdm.auto import tqdm

    names = [n for n, _ in layers]
    units = _units(model, names, blocks, max_layers)
    pristine = copy.deepcopy(model).eval()
    qmods, fmods = dict(model.named_modules()), dict(pristine.named_modules())
    gen = torch.Generator().manual_seed(seed)
    report = AdaRoundReport()
    was_training = model.training
    model.eval()
    try:
        for path, members in tqdm(units, desc="dal.ptq.adaround (blocks)", disable=not progress, leave=False):
            unit, funit = qmods[path], fmods[path]
            xq = torch.cat(capture_inputs(model, unit, data, num_batches, input_fn))
            with quantizer_states(pristine, "off"), torch.no_grad():
                xf = torch.cat(capture_inputs(pristine, funit, data, num_batches, input_fn))
                target = torch.cat([funit(xf[i:i + 64]) for i in range(0, len(xf), 64)])
            del xf
            soft = _SoftWeights(unit, path, {n: qmods[n] for n in members})
            with quantizer_states(model):
                hard, mse_near, mse_learn = _fit_unit(soft, xq, target, iters, lr, lam, batch_size, gen)
            for name, (codes, s, z, h) in hard.items():
                mod = qmods[name]
                nearest = torch.clamp(torch.round(soft.state[name][0] / s) + z, mod.weight_quant.qmin,
                                      mod.weight_quant.qmax)
                set_float_weight(mod, s * (codes - z))
                mod.weight_quant.set_state("frozen")
                report.rows.append({"layer": name, "block": path, "mse_nearest": mse_near, "mse_learned": mse_learn,
                                    "flipped": float((codes != nearest).float().mean()),
                                    "regularizer": float(round_regularizer(h, 2.0)) / h.numel(), "h": h})
            del xq, target
    finally:
        model.train(was_training)
    return report


def _units(model, names, blocks, max_layers):
    if blocks is None:
        return find_blocks(model, names, max_layers)
    mods = dict(model.named_modules())
    unknown = [b for b in blocks if b not in mods]
    if unknown:
        raise ValueError(f"adaround: blocks {unknown} are not submodules of the model")
    units, taken = [], set()
    for b in blocks:
        members = [n for n in names if n not in taken and (n == b or n.startswith(b + "."))]
        if not members:
            raise ValueError(f"adaround: block {b!r} holds none of the layers to round ({names})")
        taken.update(members)
        units.append((b, members))
    units += [(n, [n]) for n in names if n not in taken]
    order = {n: i for i, n in enumerate(names)}
    return sorted(units, key=lambda u: min(order[n] for n in u[1]))
