"""Trace the model to ONNX with every active FakeQuantizer replaced by a placeholder node.

This is the TorchScript route, export_onnx's default; dynamo_trace.py is the torch.export route
writing the same placeholders, and routes.py picks one (``route=``). Why TorchScript stays the
default: measured, the TorchScript exporter exports ResNet-18 (64x64, one thread) in ~1 s of
CPU against ~5.5-6 s for the dynamo route (torch.export, run_decompositions, onnxscript), and with
``do_constant_folding=True`` it folds everything computed from parameters - BN folding, 2:4
masks, the int32 fake quantization of biases - into initializers for free. torch's own
fake-quant symbolics cannot express INT4 / FP8, so each quantizer call becomes one node
``dal::Q(x){site=k}`` (a ``torch.autograd.Function`` with a ``symbolic``), and the side table
``sites[k]`` says which quantizer ran, on what shape. ``rewrite_*`` turn those nodes into
standard QuantizeLinear / DequantizeLinear / Cast nodes afterwards; no custom domain survives.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import warnings
from dataclasses import dataclass
from typing import Optional

import onnx
import torch
from torch import nn

from .. import nest
from ..nn.modes import eval_mode
from ..nn.tree import has_instance_attribute, instance_attributes
from ..quantizer import FakeQuantizer
from .data_flow import check_static
from .errors import ExportError
from .plan import TRACE_MAX_OPSET, ExportPlan, QuantizerEntry
from .symbolics import dal_symbolics

PLACEHOLDER_DOMAIN = "dal"
PLACEHOLDER_OP = "Q"


@dataclass
class Site:
    """One call of a quantizer during tracing."""

    entry: QuantizerEntry
    shape: tuple[int, ...]

    @property
    def quantizer(self) -> FakeQuantizer:
        return self.entry.quantizer


_IDS = itertools.count()


class _Placeholder(torch.autograd.Function):
    """Forward: the identity (a copy). ONNX: a ``dal::Q`` node naming the call site.

    The forward does not fake-quantize: the exporter computes constants itself (constant
    folding evaluates the graph, not the traced values) and the traced output is discarded,
    so running the real fake quantization of every weight would only cost time (~1 s on
    ResNet-18). A model whose Python control flow depends on quantized *values* cannot be
    traced faithfully either way.
    """

    @staticmethod
    def forward(ctx, x, site_id: int):
        return x.clone()

    @staticmethod
    def symbolic(g, x, site_id):
        out = g.op(f"{PLACEHOLDER_DOMAIN}::{PLACEHOLDER_OP}", x, site_i=int(site_id))
        out.setType(x.type())
        return out


@contextlib.contextmanager
def placeholders(plan: ExportPlan, sites: dict[int, Site], placeholder=None):
    """Swap each active quantizer's forward for a placeholder call ``placeholder(x, site)``
    (default: the TorchScript one, ``_Placeholder.apply``); always restore it."""
    swapped = []
    call = placeholder or _Placeholder.apply

    def make(entry):
        def forward(x):
            sid = next(_IDS)
            site = Site(entry, tuple(x.shape))
            sites[sid] = site
            return call(x, sid)
        return forward

    try:
        for entry in plan.active:
            q = entry.quantizer
            # An instance attribute shadows the class's forward for this object only.
            q.forward = make(entry)
            swapped.append(q)
        yield
    finally:
        for q in swapped:
            del q.forward


@contextlib.contextmanager
def flat_outputs(model: nn.Module, names: list[str]):
    """The model's output nest (dict, dataclass, ``ModelOutput``, lists, ``None`` leaves: see
    dal.nest) as the flat tuple of its tensor leaves while tracing, so the ONNX graph's outputs
    are those leaves in dal.nest's order whatever the TorchScript exporter would make of the
    nest; ``names`` receives their names. A forward hook, not a wrapper module: the scope names
    of the exported nodes and initializers stay the model's own."""

    def hook(mod, args, out):
        named = nest.named_tensors(out)
        names[:] = [n for n, _ in named]
        return None if isinstance(out, torch.Tensor) else tuple(t for _, t in named)

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _positional_forward(model: nn.Module):
    """``model.forward`` seen as ``forward(*args)`` while exporting: the TorchScript exporter
    otherwise appends the default of every parameter the example inputs do not fill, passed
    positionally (torch.onnx ``_decide_input_format``), which Hugging Face models refuse
    ("got multiple values for argument 'use_cache'"): their decorators pass those as keywords.
    The model is called with exactly the example inputs, as dal.verify and dal.convert call it."""
    had, own = has_instance_attribute(model, "forward"), instance_attributes(model).get("forward")
    bound = model.forward

    def forward(*args):
        return bound(*args)

    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = own
        else:
            del model.forward


class _Root(nn.Module):
    """A plain module around the model, so torch.onnx sees no ``.graph`` attribute."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args)


def trace(model: nn.Module, args: tuple, plan: ExportPlan, opset: int, input_names: list[str],
          output_names: Optional[list[str]], dynamic_batch: bool) -> tuple[onnx.ModelProto, dict[int, Site], list[str]]:
    """``torch.onnx.export`` (TorchScript, constant folding, eval mode) with placeholders:
    ``(proto, sites, leaf names)``. The graph's outputs are the tensor leaves of the model's
    output nest in dal.nest's order; ``leaf names`` are their dal.nest names (``output``,
    ``output.out``, ``output.aux.0``, ...), for the caller to name them by.

    Traced at ``min(opset, 20)`` (the TorchScript exporter's newest); the caller raises the
    opset import afterwards. Grad stays enabled: under ``no_grad`` the MHA fast path emits
    ``aten::_native_multi_head_attention``, which has no ONNX symbolic (vit_b_16).
    """
    sites: dict[int, Site] = {}
    dynamic_axes = None
    if dynamic_batch:
        dynamic_axes = {n: {0: "batch"} for n in input_names + list(output_names or [])}
    buf = io.BytesIO()
    leaf_names: list[str] = []
    with eval_mode(model), placeholders(plan, sites), flat_outputs(model, leaf_names), torch.enable_grad(), \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", category=torch.jit.TracerWarning)  # judged below (data_flow.py)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message=r".*custom_opsets.*|.*dal::Q.*")
        # torch's dynamic-axes check reads ``model.graph`` as a TorchScript graph; an fx
        # GraphModule (what prepare_qat returns when it rewrites the root) has an fx one.
        traced = _Root(model) if isinstance(model, torch.fx.GraphModule) else model
        try:
            with _positional_forward(traced), dal_symbolics(min(opset, TRACE_MAX_OPSET)):
                torch.onnx.export(traced, args, buf, dynamo=False, opset_version=min(opset, TRACE_MAX_OPSET),
                                  do_constant_folding=True, custom_opsets={PLACEHOLDER_DOMAIN: 1},
                                  input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes,
                                  training=torch.onnx.TrainingMode.EVAL, verbose=False)
        except Exception as exc:  # torch's message names the operator; say which step failed
            raise ExportError(f"torch.onnx.export (TorchScript) failed to trace {type(model).__name__}: "
                              f"{type(exc).__name__}: {exc}") from exc
    _after_trace(model, args, plan, seen)
    proto = onnx.load_from_string(buf.getvalue())
    if output_names is not None and len(output_names) != len(proto.graph.output):
        raise ExportError(f"output_names: {len(output_names)} name(s) {list(output_names)} for the model's "
                          f"{len(proto.graph.output)} tensor output(s) {leaf_names} (dal.nest order)")
    return proto, sites, leaf_names


def _after_trace(model, args, plan, seen) -> None:
    """The trace's warnings: any other than a TracerWarning is shown as it would have been; a
    TracerWarning (control flow on a traced tensor: on a shape, static for this input size, or on
    a value) has one more forward decide whether a value drives the flow (data_flow.py)."""
    traced_flow = False
    for w in seen:
        if issubclass(w.category, torch.jit.TracerWarning):
            traced_flow = True
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if traced_flow:
        with eval_mode(model):
            check_static(model, args, lambda: placeholders(plan, {}))
