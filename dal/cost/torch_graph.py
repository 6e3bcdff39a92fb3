"""The layers of a torch model as the cost model sees them, found by running it once.

One forward of ``example_inputs`` (eval mode, no grad, every quantizer off so that no observer
moves) recorded by :func:`dal.capture.recording`, the modules that cost time opaque (recorded
as one call each, nothing inside them; a module whose type is a registered op that is free or
not charged, and a quantizer, are opaque too: their op's cost covers their inside). Modules:

- matrix layers: every ``Conv1d/2d/3d`` / ``ConvTranspose`` and ``Linear`` (dal's QAT modules
  derive from them), ``QMatMul`` and float ``nn.MultiheadAttention`` (projections + both
  attention products), ``Embedding`` (a gather: no MACs);
- element-wise layers: ``QAdd`` / ``QMul`` / ``QCat``, pooling, softmax, layer norm, resize and
  non-linear activations, and any module whose op in :mod:`dal.ops` has ``cost="vector"`` (a
  user's ``@dal.ops.register`` op: its input and output elements). ReLU / ReLU6 / clipping cost
  nothing: they fold into the producer's requantizer (a clip of its output range). Reshapes and
  dropout are free too (``cost="free"``).

A module layer's input elements are those of every tensor it was called with (keyword arguments
included: an attention mask), its output elements those of every tensor it returned.

Function calls the model's own code makes outside those modules (``F.adaptive_avg_pool2d``,
``x + y``, ``torch.matmul`` in a forward) are layers too, by the ``cost`` of their op in
:mod:`dal.ops` (:attr:`dal.capture.Call.op`): ``"vector"``: a layer of the op's class, its
elements those of its data operands and its outputs; ``"matrix"`` (``matmul`` / ``@`` / ``bmm``):
a ``matmul`` layer between two activations, a ``linear`` one when the second operand is a
constant (``x @ W``), as the exported ``MatMul`` reads it; ``"free"`` or None: nothing. A call
computed from constants only (parameters, buffers, ``arange``...: the exporter folds it into an
initializer) is no layer, and a constant operand is not counted in a layer's input elements
(the exported graph's initializers are not either). Named ``<owner module path>.<function>``
(``Tensor.__add__`` -> ``add``; the root's calls by the function alone).

MAC counts, from the shapes seen (``K`` = kernel elements, ``g`` = groups):

    conv            out.numel() * C_in / g * K
    conv_transpose  in.numel()  * C_out / g * K
    linear          out.numel() * in_features
    matmul          out.numel() * a.shape[-1]
    attention       N * (L*E*E + S*E*kdim + S*E*vdim + 2*L*S*E + L*E*E)

A module or function called twice is two layers (``name``, ``name#2``), in the order the calls
completed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..capture import recording
from ..hardware.op_classes import ACTIVATION_OF_TYPE, op_class_of_type
from ..nn.adopt import float_class_of
from ..nn.modes import eval_mode
from ..nn.registry import op_class_of
from ..quantizer import FakeQuantizer, quantizer_states
from .op_costs import free_activations, module_cost, vector_classes
from .roofline import LayerGeom


def _numel(metas) -> int:
    return sum(m.numel for m in metas)


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


def _attention(mod: nn.MultiheadAttention, in_meta) -> dict:
    q, k = in_meta[0].shape, in_meta[1].shape if len(in_meta) > 1 else in_meta[0].shape
    if len(q) == 2:  # unbatched (L, E)
        q, k = (q[0], 1, q[1]), (k[0], 1, k[1])
    if mod.batch_first:
        q, k = (q[1], q[0], q[2]), (k[1], k[0], k[2])
    L, N, E = q
    S = k[0]
    macs = N * (L * E * E + S * E * mod.kdim + S * E * mod.vdim + 2 * L * S * E + L * E * E)
    weights = sum(p.numel() for n, p in mod.named_parameters() if n.endswith("weight"))
    return dict(macs=macs, weight_elems=weights, in_channels=E, out_channels=E)


def _geometry(name: str, mod: nn.Module, op_class: str, in_meta, out_meta) -> LayerGeom:
    """The layer of one costed module call, from the shapes its call read and wrote."""
    kw = dict(input_elems=_numel(in_meta), output_elems=_numel(out_meta))
    o = out_meta[0] if out_meta else None
    if isinstance(mod, nn.MultiheadAttention):
        kw.update(_attention(mod, in_meta))
    elif op_class in ("conv", "conv_transpose"):
        k = math.prod(mod.kernel_size)
        per = (mod.in_channels if op_class == "conv" else mod.out_channels) // mod.groups
        base = o.numel if op_class == "conv" else in_meta[0].numel
        kw.update(macs=base * per * k, weight_elems=mod.weight.numel(), in_channels=mod.in_channels,
                  out_channels=mod.out_channels)
    elif op_class == "linear":
        kw.update(macs=o.numel * mod.in_features, weight_elems=mod.weight.numel(),
                  in_channels=mod.in_features, out_channels=mod.out_features)
    elif op_class == "matmul":
        kw.update(macs=o.numel * in_meta[0].shape[-1], in_channels=in_meta[0].shape[-1],
                  out_channels=in_meta[1].shape[-1])
    elif op_class == "embedding":
        kw.update(weight_elems=kw["output_elems"], input_elems=0)
    fn = ACTIVATION_OF_TYPE.get(type(mod).__name__, type(mod).__name__.lower()) if op_class == "activation" else ""
    return LayerGeom(name, op_class, int(kw.pop("macs", 0)), function=fn, type_name=type(mod).__name__,
                     **{k: int(v) for k, v in kw.items()})


def _opaque_layers(model: nn.Module):
    """``(opaque, classes)``: the capture's ``opaque(module)`` predicate and the op class it found
    for each module called (``id -> op_class_for``). Recorded as one call, nothing inside it: a
    costed layer; any module whose type is a registered op (its ``cost``, ``"free"`` or None
    included, covers its inside: a user op declared free is free whole); a quantizer."""
    classes: dict = {}

    def opaque(mod: nn.Module) -> bool:
        cls = classes.get(id(mod), False)
        if cls is False:
            cls = classes[id(mod)] = op_class_for(mod)
        return (cls is not None or isinstance(mod, FakeQuantizer)
                or ops.by_module(float_class_of(mod) or type(mod)) is not None)

    return opaque, classes


def _constants(record, model: nn.Module) -> set:
    """The value keys computed from the model's parameters and buffers and from tensors the
    forward made without reading any input (``arange``, ``zeros``): the exporter folds them into
    initializers (``do_constant_folding``), so no layer computes them. A model input, or a
    tensor the record first met inside the forward (made by code it does not see), is data."""
    const = {k for t in [*model.parameters(), *model.buffers()] if (k := record.key_of(t)) is not None}
    for call in record.calls:
        if (call.kind == "function" or call.opaque) and all(k in const for k in call.ins):
            const.update(call.outs)
    return const


def _function_name(fn) -> str:
    """A callable's name without dunders (``Tensor.__add__`` -> ``add``)."""
    return (getattr(fn, "__name__", "") or type(fn).__name__).strip("_")


def _function_geometry(call, constant: set) -> Optional[LayerGeom]:
    """The layer of one function call (module docstring; the caller names it), or None when
    its op is free or not charged, or it reads constants only."""
    op = call.op
    if op is None or op.cost not in ("vector", "matrix"):
        return None
    ins = list(zip(call.ins, call.in_meta))
    data = [m for k, m in ins if k not in constant]
    if not data:
        return None
    fname, out = _function_name(call.target), _numel(call.out_meta)
    if op.cost == "vector":
        fn = (op.function or op.name) if op.op_class == "activation" else ""
        return LayerGeom("", op.op_class, 0, input_elems=_numel(data), output_elems=out,
                         function=fn, type_name=fname)
    if op.op_class != "matmul" or len(ins) != 2:
        raise ValueError(f"dal.cost: {fname} at {call.path or '<root>'} is op {op.name!r} (cost='matrix', "
                         f"op class {op.op_class!r}) called on {len(ins)} tensor(s); the cost model has a MAC formula "
                         "for a function call only for matmul on two tensors (a @ b): register it with a module")
    (ka, a), (kb, b) = ins[::-1] if fname == "rmatmul" else ins
    weighted = kb in constant  # a @ W with W a parameter: a linear layer, as the exported MatMul reads it
    k, n = (a.shape[-1] if a.shape else 1), (b.shape[-1] if len(b.shape) > 1 else 1)
    return LayerGeom("", "linear" if weighted else "matmul", out * k, b.numel if weighted else 0,
                     a.numel + (0 if weighted else b.numel), out, k, n, type_name=fname)


def trace_layers(model: nn.Module, example_inputs) -> list[tuple[LayerGeom, Optional[nn.Module]]]:
    """(geometry, module) of every costed layer in execution order, a function call's module
    None (see the module docstring). One forward of ``example_inputs`` recorded by
    :func:`dal.capture.recording` (costed layers opaque), in eval mode, without grad, every
    quantizer off."""
    if not isinstance(example_inputs, (list, tuple)):
        example_inputs = (example_inputs,)
    opaque, classes = _opaque_layers(model)
    with torch.no_grad(), eval_mode(model), quantizer_states(model, "off"), \
            recording(model, opaque=opaque) as record:
        model(*example_inputs)
    constant = _constants(record, model)
    found: list = []
    calls: dict = {}

    def label(name: str) -> str:
        calls[name] = calls.get(name, 0) + 1
        return name if calls[name] == 1 else f"{name}#{calls[name]}"

    for call in record.calls:
        if call.kind == "module":
            op_class = classes.get(id(call.target)) if call.opaque else None
            if op_class is not None:
                found.append((_geometry(label(call.path), call.target, op_class, call.in_meta, call.out_meta),
                              call.target))
            continue
        geom = _function_geometry(call, constant)
        if geom is not None:
            fname = _function_name(call.target)
            found.append((dataclasses.replace(geom, name=label(f"{call.path}.{fname}" if call.path else fname)), None))
    return found
