"""Generic replacement of ``F.scaled_dot_product_attention`` calls inside a module's own forward.

The module's forward is traced with torch.fx (its submodules as leaves); each SDPA call whose
``dropout_p`` / ``is_causal`` / ``scale`` are constants becomes a call of an :class:`NpuSDPA`
child (explicit matmuls, the hardware's softmax). The result is an instance of a subclass of the
module's own class whose ``forward`` is the rewritten graph (same Parameters, submodules and
attributes; ``isinstance`` still holds), so prepare keeps rewriting its other functional ops.
An ``is_causal`` that is the forward's own argument (timm's ``Attention``) is passed to the
NpuSDPA at run time. Not feasible (left alone): forwards that do not trace, other SDPA arguments
computed at run time, ``enable_gqa=True``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..nn.own_forward import attributes_kept
from ..nn.tree import set_child, shallow_copy
from .core import NpuAttentionCore

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):  # only the module's own forward is traced
        return True


def _sdpa_mask(q: torch.Tensor, k: torch.Tensor, attn_mask, is_causal: bool):
    """SDPA's masks as one additive mask: bool True = attend (the opposite of MHA's)."""
    lq, lk = q.shape[-2], k.shape[-2]
    total = None
    if is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril_()
        total = torch.zeros(lq, lk, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=q.dtype, device=m.device).masked_fill_(~m, float("-inf"))
        total = m if total is None else total + m
    return total


torch.fx.wrap("_sdpa_mask")


class NpuSDPA(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)`` with
    explicit matmuls (in :class:`NpuAttentionCore`) and the hardware's softmax.

    Dropout runs in training mode only (nn.Dropout), which is what the usual
    ``dropout_p=self.p if self.training else 0.0`` idiom means; the traced constant is the
    probability seen when the module was replaced.
    """

    def __init__(self, dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                 softmax_mode: Union[str, bool] = "fp16"):
        super().__init__()
        self.is_causal = bool(is_causal)
        self.core = NpuAttentionCore(scale, float(dropout_p), softmax_mode, name="core")

    def forward(self, q, k, v, attn_mask=None, is_causal=None):
        """``is_causal``: the call's own value when the forward passes its argument through (timm's
        ``Attention.forward(x, attn_mask=None, is_causal=False)``), else the traced constant."""
        causal = self.is_causal if is_causal is None else bool(is_causal)
        out, _ = self.core(q, k, v, None, _sdpa_mask(q, k, attn_mask, causal))
        return out

    def extra_repr(self) -> str:
        return f"is_causal={self.is_causal}, scale={self.core.scale}"


def _sdpa_call(node: fx.Node) -> Optional[dict]:
    """The SDPA node's arguments by name, or None when it is not one or not feasible."""
    if node.op != "call_function" or node.target is not F.scaled_dot_product_attention:
        return None
    args = dict(zip(_SDPA_ARGS, node.args))
    args.update(node.kwargs)
    for const in ("dropout_p", "is_causal", "scale", "enable_gqa"):
        value = args.get(const)
        if isinstance(value, fx.Node) and not (const == "is_causal" and value.op == "placeholder"):
            return None  # is_causal may be the forward's own argument: NpuSDPA takes it at run time
    if args.get("enable_gqa"):
        return None
    return args


def sdpa_graph(mod: nn.Module) -> Optional[fx.Graph]:
    """The own-forward graph of ``mod`` when it calls SDPA feasibly, else None."""
    if isinstance(mod, fx.GraphModule) or type(mod).__module__.startswith(("torch.", "dal.")):
        return None
    try:
        with attributes_kept(mod):  # a forward that caches on itself keeps no Proxy
            graph = _LeafTracer().trace(mod)
    except Exception:  # noqa: BLE001 - a forward that does not trace is simply not a candidate
        return None
    return graph if any(_sdpa_call(n) for n in graph.nodes) else None


def replace_sdpa(mod: nn.Module, softmax_mode: Union[str, bool] = "fp16") -> nn.Module:
    """A copy of ``mod`` (same Parameters, buffers, submodules, attributes) whose forward calls
    an NpuSDPA child for every feasible SDPA call."""
    graph = sdpa_graph(mod)
    if graph is None:
        raise ValueError(f"{type(mod).__name__} has no feasible F.scaled_dot_product_attention call")
    added = {}
    for i, node in enumerate([n for n in graph.nodes if _sdpa_call(n)]):
        a = _sdpa_call(node)
        name = "npu_sdpa" if i == 0 else f"npu_sdpa_{i}"
        while hasattr(mod, name) or name in added:
            name += "_"
        causal = a.get("is_causal", False)
        runtime = isinstance(causal, fx.Node)
        added[name] = NpuSDPA(a.get("dropout_p", 0.0) or 0.0, False if runtime else causal, a.get("scale"),
                              softmax_mode)
        call_args = (a["query"], a["key"], a["value"], a.get("attn_mask")) + ((causal,) if runtime else ())
        with graph.inserting_after(node):
            new = graph.call_module(name, call_args)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.lint()
    holder = shallow_copy(mod, nn.Module)
    for name, m in added.items():
        set_child(holder, name, m)
    gm = fx.GraphModule(holder, graph)
    cls = type(f"{type(mod).__name__}NpuSDPA", (type(mod),),
               {"forward": type(gm).forward, "__module__": __name__, "__doc__": f"{type(mod).__name__} with NpuSDPA"})
    new = shallow_copy(mod, cls)
    for name, m in added.items():
        set_child(new, name, m.train(mod.training))
    return new
