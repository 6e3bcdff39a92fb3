"""Empirical bias correction (Nagel et al., "Data-Free Quantization Through Weight Equalization
and Bias Correction", ICCV 2019, section 4.2, empirical variant; Finkelstein et al. 2019).

Quantization shifts the mean of each output channel. Measured on calibration data, layer by
layer in execution order (each correction changes what the later layers see):

    delta_c = E[ op(x_f, W)_c ] - E[ op(fq_in(x_q), Q(W))_c ]        (no bias on either side)
    b_c    <- b_c + delta_c

``x_f`` is the float model's input of the layer, ``x_q`` the quantized model's (with the
corrections of the layers before it). ``E`` averages over samples and positions. For a
QConvBn2d the correction goes into the BatchNorm's beta (the folded bias moves by the same
amount); a layer without bias gets one (a zero bias parameter, which exports as an int32 bias).
"""
from __future__ import annotations

import copy
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..nn.conv_bn import QConvBn2d
from ..quantizer import quantizer_states
from .layers import StopForward, channel_mean, pre_activation, run_hooked, weighted_layers


def _layer_means(model, mods, data, num_batches, input_fn, stop_after=None):
    """Mean pre-activation per channel of each module in ``mods`` (a forward per batch)."""
    sums: dict = {}
    counts: dict = {}

    def make_hook(mod):
        def hook(_m, args):
            with torch.no_grad():
                m = channel_mean(mod, pre_activation(mod, args[0]))
            sums[mod] = sums.get(mod, 0) + m
            counts[mod] = counts.get(mod, 0) + 1
            if mod is stop_after:
                raise StopForward
        return hook

    run_hooked(model, [m.register_forward_pre_hook(make_hook(m)) for m in mods], data, num_batches, input_fn)
    return {m: sums[m] / counts[m] for m in sums}


def _add_to_bias(mod: nn.Module, delta: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(mod, QConvBn2d) and getattr(mod.bn, "affine", True):  # a frozen BN (conv_frozen_bn.py): its bias buffer
            mod.bn.bias.add_(delta)
        elif mod.bias is not None:
            mod.bias.add_(delta)
        else:
            mod.bias = nn.Parameter(delta.clone())


def bias_correction(model: nn.Module, data: Iterable, num_batches: Optional[int] = None, *,
                    layers: Optional[list] = None, input_fn: Optional[Callable] = None,
                    progress: bool = True) -> dict:
    """Correct the bias of every calibrated integer-weight layer of a prepared ``model`` in place
    (formula in the module docstring). Returns ``{layer path: delta tensor}``.

    Cost: one float forward for all layers' float means, then one forward per layer that stops
    right after the layer (the prefix of the network only).

    Example:
        >>> dal.calibrate(qmodel, calib); dal.ptq.bias_correction(qmodel, calib)   # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    chosen = [(n, m) for n, m in weighted_layers(model, data, input_fn) if layers is None or n in set(layers)]
    was_training = model.training
    model.eval()
    pristine = copy.deepcopy(model)
    pmods = dict(pristine.named_modules())
    out = {}
    try:
        with quantizer_states(pristine, "off"):
            fmeans = _layer_means(pristine, [pmods[n] for n, _ in chosen], data, num_batches, input_fn)
        for name, mod in tqdm(chosen, desc="dal.ptq.bias_correction", disable=not progress, leave=False):
            qmean = _layer_means(model, [mod], data, num_batches, input_fn, stop_after=mod)[mod]
            delta = fmeans[pmods[name]] - qmean
            _add_to_bias(mod, delta)
            out[name] = delta
    finally:
        model.train(was_training)
    return out
