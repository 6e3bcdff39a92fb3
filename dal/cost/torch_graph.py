"""The layers of a torch model as the cost model sees them, found by running it once.

One forward of ``example_inputs`` (eval mode, no grad, every quantizer off so that no observer
moves) with hooks on the modules that cost time:

- matrix layers: every ``Conv1d/2d/3d`` / ``ConvTranspose`` and ``Linear`` (dal's QAT modules
  derive from them), ``QMatMul`` and float ``nn.MultiheadAttention`` (projections + both
  attention products), ``Embedding`` (a gather: no MACs);
- element-wise layers: ``QAdd`` / ``QMul`` / ``QCat``, pooling, softmax, layer norm, resize and
  non-linear activations, and any module whose op in :mod:`dal.ops` has ``cost="vector"`` (a
  user's ``@dal.ops.register`` op: its input and output elements). ReLU / ReLU6 / clipping cost
  nothing: they fold into the producer's requantizer (a clip of its output range). Reshapes and
  dropout are free too (``cost="free"``).

MAC counts, from the shapes seen (``K`` = kernel elements, ``g`` = groups):

    conv            out.numel() * C_in / g * K
    conv_transpose  in.numel()  * C_out / g * K
    linear          out.numel() * in_features
    matmul          out.numel() * a.shape[-1]
    attention       N * (L*E*E + S*E*kdim + S*E*vdim + 2*L*S*E + L*E*E)

A module called twice is two layers (``name``, ``name#2``). Only modules are seen: a functional
op the model calls itself (``F.adaptive_avg_pool2d`` in a forward) is not listed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..hardware.op_classes import ACTIVATION_OF_TYPE, op_class_of_type
from ..nn.adopt import float_class_of
from ..nn.modes import eval_mode
from ..nn.registry import op_class_of
from ..quantizer import quantizer_states
from .op_costs import free_activations, module_cost, vector_classes
from .roofline import LayerGeom


def _tensors(x) -> list[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _numel(x) -> int:
    return sum(t.numel() for t in _tensors(x))


def op_class_for(mod: nn.Module) -> Optional[str]:
    """The op class the cost model times ``mod`` as, or None when it is free or not a layer.

    Convolutions, linear layers, embeddings and ``nn.MultiheadAttention`` by type (their QAT
    modules and fusions derive from them); any other module by the ``cost`` of its op in
    :mod:`dal.ops` (``dal.cost.op_costs``: ``"free"`` -> None, else the op's class), a user's
    ``@dal.ops.register`` op included; failing that, by its op class: charged when some op of
    that class is a vector op or when it is ``matmul``, free for the activations whose ops
    cost nothing (relu, relu6, hardtanh)."""
    if isinstance(mod, nn.MultiheadAttention):
        return "linear"
    if isinstance(mod, nn.modules.conv._ConvNd):
        return "conv_transpose" if mod.transposed else "conv"
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.Embedding):
        return "embedding"
    own = module_cost(mod, float_class_of(mod))
    if own is not None:
        return None if own[0] == "free" else own[1]
    cls = op_class_of(mod)
    if cls == "custom":
        cls = op_class_of_type(type(mod).__name__)
    if cls == "activation" and ACTIVATION_OF_TYPE.get(type(mod).__name__) in free_activations():
        return None
    return cls if cls in vector_classes() or cls == "matmul" else None


def _attention(mod: nn.MultiheadAttention, args, out_elems: int) -> dict:
    q, k = args[0], args[1] if len(args) > 1 else args[0]
    if q.dim() == 2:  # unbatched (L, E)
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    if mod.batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    L, N, E = q.shape
    S = k.shape[0]
    macs = N * (L * E * E + S * E * mod.kdim + S * E * mod.vdim + 2 * L * S * E + L * E * E)
    weights = sum(p.numel() for n, p in mod.named_parameters() if n.endswith("weight"))
    return dict(macs=macs, weight_elems=weights, in_channels=E, out_channels=E)


def _geometry(name: str, mod: nn.Module, op_class: str, args, out) -> LayerGeom:
    ins, out_t = _tensors(args), _tensors(out)
    kw = dict(input_elems=_numel(ins), output_elems=_numel(out_t))
    o = out_t[0] if out_t else None
    if isinstance(mod, nn.MultiheadAttention):
        kw.update(_attention(mod, args, kw["output_elems"]))
    elif op_class in ("conv", "conv_transpose"):
        k = math.prod(mod.kernel_size)
        per = (mod.in_channels if op_class == "conv" else mod.out_channels) // mod.groups
        base = o.numel() if op_class == "conv" else ins[0].numel()
        kw.update(macs=base * per * k, weight_elems=mod.weight.numel(), in_channels=mod.in_channels,
                  out_channels=mod.out_channels)
    elif op_class == "linear":
        kw.update(macs=o.numel() * mod.in_features, weight_elems=mod.weight.numel(),
                  in_channels=mod.in_features, out_channels=mod.out_features)
    elif op_class == "matmul":
        kw.update(macs=o.numel() * ins[0].shape[-1], in_channels=ins[0].shape[-1], out_channels=ins[1].shape[-1])
    elif op_class == "embedding":
        kw.update(weight_elems=kw["output_elems"], input_elems=0)
    fn = ACTIVATION_OF_TYPE.get(type(mod).__name__, type(mod).__name__.lower()) if op_class == "activation" else ""
    return LayerGeom(name, op_class, int(kw.pop("macs", 0)), function=fn, type_name=type(mod).__name__,
                     **{k: int(v) for k, v in kw.items()})


def trace_layers(model: nn.Module, example_inputs) -> list[tuple[LayerGeom, nn.Module]]:
    """(geometry, module) of every costed layer in execution order (see the module docstring)."""
    if not isinstance(example_inputs, (list, tuple)):
        example_inputs = (example_inputs,)
    found: list = []
    calls: dict = {}
    depth = [0]
    handles = []

    def pre(mod, args):
        depth[0] += 1

    def post(mod, args, out, name, op_class):
        depth[0] -= 1
        if depth[0] == 0:  # outermost costed module: its own children are part of it
            calls[name] = calls.get(name, 0) + 1
            label = name if calls[name] == 1 else f"{name}#{calls[name]}"
            found.append((_geometry(label, mod, op_class, args, out), mod))

    for name, mod in model.named_modules():
        op_class = op_class_for(mod)
        if op_class is None:
            continue
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name, c=op_class: post(m, a, o, n, c)))
    try:
        with torch.no_grad(), eval_mode(model), quantizer_states(model, "off"):
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return found
