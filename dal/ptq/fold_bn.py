"""Fold BatchNorm into the preceding convolution / linear layer of a *float* model.

    f = gamma / sqrt(running_var + eps)
    W' = W * f (per output channel),   b' = beta + (b - running_mean) * f

(torch.nn.utils.fusion.fuse_conv_bn_weights / fuse_linear_bn_weights). The BatchNorm becomes
``nn.Identity``. PTQ practice (and cross-layer equalization, which needs the scales in the
weights) starts from the folded network; the float function is unchanged up to float32 rounding.
Pairs are found on a ``torch.fx`` trace: a conv / linear whose only user is a BatchNorm.
"""
from __future__ import annotations

import torch
from torch import nn

from ..nn.norm import batch_norm_types
from ..sparsity.layout import weighted_types


def conv_types() -> tuple:
    """The convolutions a BatchNorm folds into: nn.Conv1d / 2d / 3d (weight ``[out, in/groups, *k]``;
    dal.sparsity.layout.weighted_types of op class conv, read from dal.ops)."""
    return weighted_types("conv")


def __getattr__(name: str):
    """``CONV_TYPES`` (:func:`conv_types`) and ``BN_TYPES`` (dal.nn.norm.batch_norm_types), derived
    from dal.ops when read."""
    if name == "CONV_TYPES":
        return conv_types()
    if name == "BN_TYPES":
        return batch_norm_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def traced(model: nn.Module, leaves: tuple = ()):
    """``torch.fx.symbolic_trace(model)`` (modules of the ``leaves`` types kept as calls, not
    traced into) with an error that says what failed."""
    import torch.fx

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

    try:
        tracer = _Tracer()
        graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as exc:  # noqa: BLE001 - fx raises many types; the message is what counts
        raise ValueError(f"dal.ptq: {type(model).__name__} does not trace with torch.fx "
                         f"({type(exc).__name__}: {exc}); apply the step to a traceable submodule") from exc


def fold_batchnorm(model: nn.Module) -> list[tuple[str, str]]:
    """Fold every BatchNorm that directly follows a conv / linear of float ``model`` (in eval
    mode) into it, in place; returns the ``(layer, batchnorm)`` paths folded.

    Example:
        >>> pairs = dal.ptq.fold_batchnorm(net.eval())   # doctest: +SKIP
    """
    from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

    if model.training:
        raise ValueError("fold_batchnorm: put the model in eval mode first (folding uses the running statistics)")
    gm = traced(model)
    mods = dict(model.named_modules())
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(mods.get(node.target), batch_norm_types()):
            continue
        src = node.args[0]
        if getattr(src, "op", None) != "call_module" or len(src.users) != 1:
            continue
        layer, bn = mods.get(src.target), mods[node.target]
        if not bn.track_running_stats or bn.running_mean is None:
            continue
        with torch.no_grad():
            if isinstance(layer, conv_types()) and layer.out_channels == bn.num_features:
                w, b = fuse_conv_bn_weights(layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps,
                                            bn.weight, bn.bias)
            elif isinstance(layer, nn.Linear) and layer.out_features == bn.num_features:
                w, b = fuse_linear_bn_weights(layer.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps,
                                              bn.weight, bn.bias)
            else:
                continue
        layer.weight = nn.Parameter(w.detach())
        layer.bias = nn.Parameter(b.detach())
        set_module(model, node.target, nn.Identity())
        pairs.append((src.target, node.target))
    return pairs
