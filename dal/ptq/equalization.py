"""Cross-layer equalization, data-free (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", ICCV 2019, section 4.1).

For two consecutive layers ``y = W2 f(W1 x + b1) + b2`` with ``f`` positively homogeneous per
channel (ReLU, identity: ``f(x / s) = f(x) / s`` for ``s > 0``), output channel ``i`` of layer 1
can be divided by ``s_i`` and input channel ``i`` of layer 2 multiplied by it without changing
the function. The choice that gives both the same range,

    r1_i = max |W1[i, ...]|,  r2_i = max |W2[:, i, ...]|  (depthwise W2: max |W2[i, ...]|)
    s_i  = sqrt(r1_i / r2_i)    ->   max |W1'[i]| = max |W2'[:, i]| = sqrt(r1_i * r2_i)

is what per-tensor weight quantization wants. Depthwise layers are equalized on either side
(their output channel ``i`` depends on input channel ``i`` only); chains (conv -> depthwise ->
pointwise) are swept until no scale moves by more than 0.1% (at most ``iterations`` sweeps).

ReLU6 is not homogeneous (``relu6(x / s) != relu6(x) / s``): with ``relu6="clip"`` (default) it
becomes a per-channel clip ``ChannelClip(0, 6 / s_i)``, which keeps the function unchanged;
``"relu"`` replaces it by ReLU as the paper does (changes the function where activations pass 6);
``"skip"`` leaves such pairs alone. Apply to a float model with BatchNorm folded
(``fold_batchnorm``) before ``prepare_qat``.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from .fold_bn import conv_types, set_module, traced


class ChannelClip(nn.Module):
    """``clamp(x, 0, upper_c)`` per channel (dim 1): a ReLU6 after equalization scaled its channels."""

    def __init__(self, upper: torch.Tensor):
        super().__init__()
        self.register_buffer("upper", upper.detach().clone().float())

    def forward(self, x):
        shape = [1, -1] + [1] * (x.dim() - 2)
        return torch.minimum(torch.relu(x), self.upper.reshape(shape).to(x.dtype))


def _is_depthwise(m) -> bool:
    return isinstance(m, conv_types()) and m.groups == m.in_channels == m.out_channels and m.groups > 1


def _weighted(m) -> bool:
    return (isinstance(m, conv_types()) and (m.groups == 1 or _is_depthwise(m))) or isinstance(m, nn.Linear)


@functools.cache
def _relu_functions() -> frozenset:
    """The out-of-place functions of dal.ops' ``relu`` (torch.relu, F.relu): homogeneous,
    ``relu(x / s) == relu(x) / s`` for ``s > 0``. (The in-place torch.relu_ is not matched.)"""
    from ..ops import get

    return frozenset(f for f in get("relu").functions if not f.__name__.endswith("_"))


def _activation_kind(node, mods):
    if node.op == "call_module":
        m = mods.get(node.target)
        if isinstance(m, (nn.Identity, nn.ReLU)):
            return "homogeneous"
        if isinstance(m, ChannelClip):
            return "clip"
        if isinstance(m, nn.ReLU6) or (isinstance(m, nn.Hardtanh) and (m.min_val, m.max_val) == (0.0, 6.0)):
            return "relu6"
    if node.op == "call_function" and node.target in _relu_functions():
        return "homogeneous"
    return None


def equalization_pairs(model: nn.Module) -> list[tuple[str, list, str]]:
    """``(layer1, [activation nodes], layer2)`` of every equalizable pair of float ``model``."""
    gm = traced(model, leaves=(ChannelClip,))
    mods = dict(model.named_modules())
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not _weighted(mods.get(node.target)):
            continue
        chain, cur = [], node
        while len(cur.users) == 1:
            nxt = next(iter(cur.users))
            if nxt.op == "call_module" and _weighted(mods.get(nxt.target)):
                if nxt.args and nxt.args[0] is cur:
                    pairs.append((node.target, chain, nxt.target))
                break
            kind = _activation_kind(nxt, mods)
            if kind is None:
                break
            chain.append((nxt, kind))
            cur = nxt
    return pairs


def _in_channel_range(w2: torch.Tensor, depthwise: bool) -> torch.Tensor:
    if depthwise:
        return w2.abs().flatten(1).amax(1)
    return w2.abs().transpose(0, 1).flatten(1).amax(1)


def _scale_pair(m1, m2, acts, mods, model, relu6: str) -> float:
    w1, w2 = m1.weight.detach(), m2.weight.detach()
    r1 = w1.abs().flatten(1).amax(1)
    r2 = _in_channel_range(w2, _is_depthwise(m2))
    if r1.shape != r2.shape:
        return 0.0
    s = torch.sqrt(r1 / r2)
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    view = (-1,) + (1,) * (w1.dim() - 1)
    with torch.no_grad():
        m1.weight.div_(s.reshape(view))
        if m1.bias is not None:
            m1.bias.div_(s)
        if _is_depthwise(m2):
            m2.weight.mul_(s.reshape((-1,) + (1,) * (w2.dim() - 1)))
        else:
            m2.weight.mul_(s.reshape((1, -1) + (1,) * (w2.dim() - 2)))
        for node, kind in acts:
            if isinstance(mods.get(node.target), ChannelClip):  # a ReLU6 an earlier sweep replaced
                mods[node.target].upper.div_(s)
            elif kind == "relu6":
                new = ChannelClip(torch.full_like(s, 6.0) / s) if relu6 == "clip" else nn.ReLU()
                set_module(model, node.target, new)
                mods[node.target] = new
    return float((s.log().abs()).max())


def equalize(model: nn.Module, iterations: int = 50, relu6: str = "clip") -> list[tuple[str, str]]:
    """Equalize every conv/linear pair of float ``model`` in place (module docstring);
    returns the ``(layer1, layer2)`` pairs scaled. The float function is unchanged (float32
    rounding aside); BatchNorm must be folded first (``fold_batchnorm``), else the pairs it
    separates are not found.

    Example:
        >>> dal.ptq.fold_batchnorm(net.eval()); dal.ptq.equalize(net)   # doctest: +SKIP
    """
    if relu6 not in ("clip", "relu", "skip"):
        raise ValueError(f"equalize: relu6={relu6!r} is not one of 'clip', 'relu', 'skip'")
    done: list = []
    pairs = equalization_pairs(model)  # traced once: sweeps only change weights and clip bounds
    mods = dict(model.named_modules())
    for _ in range(max(int(iterations), 1)):
        moved = 0.0
        for a, acts, b in pairs:
            if relu6 == "skip" and any(kind == "relu6" for _, kind in acts):
                continue
            moved = max(moved, _scale_pair(mods[a], mods[b], acts, mods, model, relu6))
            if (a, b) not in done:
                done.append((a, b))
        if moved < 1e-3:
            break
    return done
