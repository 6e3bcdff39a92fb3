"""What every PTQ algorithm shares: the quantized weighted layers of a prepared model, their
pre-activation output, and the inputs a layer sees on calibration data.

``pre_activation(mod, x)`` is ``op(input_quant(x), Q(W), None)`` with the module's *current*
quantizer states, so the same call gives the float layer inside ``quantizer_states(model, "off")``.
Inputs are captured by a forward that stops right after the layer (``StopForward``): capturing layer
``l`` costs the prefix of the network up to ``l``, not a whole forward.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..calibration.batches import iter_inputs
from ..nn.base import QWeightedModule
from ..nn.conv_bn import QConvBn2d
from ..nn.modes import eval_mode


class StopForward(BaseException):
    """Raised by a capture hook to end the forward once the layer of interest has run; a
    BaseException so that no ``except Exception`` on the way (fx, user code) swallows it."""


def weighted_layers(model: nn.Module, data: Optional[Iterable] = None,
                    input_fn: Optional[Callable] = None) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every QAT conv / linear with an active integer weight quantizer, in
    execution order on the first batch of ``data`` (registration order without data; a layer
    that did not run on that batch goes last)."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (QWeightedModule, QConvBn2d)):
            continue
        wq = getattr(mod, "weight_quant", None)
        if wq is None or not wq.fmt.is_integer or not wq.initialized or wq.state not in ("quantize", "frozen"):
            continue
        out.append((name, mod))
    if data is None or not out:
        return out
    order: dict = {}

    def seen(mod, _args):
        order.setdefault(mod, len(order))  # returns None: a pre-hook's return value replaces the input

    hooks = [m.register_forward_pre_hook(seen) for _, m in out]
    try:
        with torch.no_grad(), eval_mode(model):
            for args, kwargs in iter_inputs(data, 1, input_fn=input_fn, desc="dal.ptq"):
                model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return sorted(out, key=lambda nm: order.get(nm[1], len(out)))


def float_weight(mod: nn.Module) -> torch.Tensor:
    """The float weight the weight quantizer sees (BN folded for QConvBn2d)."""
    if isinstance(mod, QConvBn2d):
        return mod.folded_weight_and_bias()[0]
    return mod.weight


def unfolded_weight(mod: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """The ``mod.weight`` for which ``float_weight(mod)`` is ``w`` (QConvBn2d: ``w / f``); differentiable."""
    if isinstance(mod, QConvBn2d):
        return mod.unfold_weight(w)
    return w


def set_float_weight(mod: nn.Module, w: torch.Tensor) -> None:
    """Make ``float_weight(mod)`` equal ``w`` (for QConvBn2d: the unfolded weight ``w / f``)."""
    with torch.no_grad():
        mod.weight.copy_(unfolded_weight(mod, w))


def linear_op(mod: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``op(x, w)`` without bias: the conv / linear arithmetic of ``mod`` with weight ``w``."""
    if isinstance(mod, nn.Linear):
        return torch.nn.functional.linear(x, w)
    return mod._conv_forward(x, w, None)


def pre_activation(mod: nn.Module, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``op(input_quant(x), Q(W))`` (no bias, no activation) with the module's current states;
    ``weight`` replaces ``Q(W)`` when given (AdaRound's soft-rounded weight)."""
    if mod.input_quant is not None:
        x = mod.input_quant(x)
    w = mod.quantized_weight(float_weight(mod)) if weight is None else weight
    return linear_op(mod, x, w)


def capture_inputs(model: nn.Module, mod: nn.Module, data: Iterable, num_batches: Optional[int] = None,
                   input_fn: Optional[Callable] = None) -> list[torch.Tensor]:
    """The input tensor ``mod`` receives for each calibration batch (the forward stops after it)."""
    seen: list = []

    def hook(_m, args):
        seen.append(args[0].detach())
        raise StopForward

    run_hooked(model, [mod.register_forward_pre_hook(hook)], data, num_batches, input_fn)
    if not seen:
        name = getattr(mod, "qat_name", "") or type(mod).__name__
        raise ValueError(f"dal.ptq: layer {name} never ran on the calibration data")
    return seen


def run_hooked(model: nn.Module, handles: list, data: Iterable, num_batches: Optional[int],
               input_fn: Optional[Callable]) -> None:
    """Run ``model`` without grad on the calibration batches while the hooks of ``handles`` watch
    it (a hook may end a batch early by raising ``StopForward``); the hooks are removed after,
    also on error."""
    try:
        with torch.no_grad():
            for args, kwargs in iter_inputs(data, num_batches, input_fn=input_fn, desc="dal.ptq"):
                try:
                    model(*args, **kwargs)
                except StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()


def channel_mean(mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """Mean of ``y`` per output channel: the last dim for linear, dim 1 for conv outputs."""
    if isinstance(mod, nn.Linear):
        return y.reshape(-1, y.shape[-1]).mean(0)
    return y.transpose(0, 1).reshape(y.shape[1], -1).mean(1)
