"""dal.export_onnx: a QAT model -> a QDQ ONNX file (the contract is export/SPEC.md)."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Optional, Sequence, Union

import onnx
import torch
from torch import nn

from ..prepare.boundary import boundary_json, check_batch, npu_part
from .attention_mask import check_attention_mask
from .bias import rewrite_biases
from .bias_range import check_bias_codes
from .casts import rewrite_float_casts
from .errors import ExportError
from .float64_check import check_no_float64_quantize
from .fold import fold_constants
from .graph import Graph
from .metadata import write_metadata
from .plan import TRACE_MAX_OPSET, make_plan
from .qdq import is_placeholder, rewrite_scaled
from .routes import DEFAULT_ROUTE, try_dynamo
from .trace import PLACEHOLDER_DOMAIN, trace

# Operators whose meaning changed between opset 20 (where the graph is traced) and 21..23.
# torch's TorchScript exporter does not emit GroupNormalization, but a refusal is cheap insurance.
_CHANGED_AFTER_20 = {"GroupNormalization"}


def export_onnx(model: nn.Module, example_inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
                path: Optional[Union[str, os.PathLike]] = None, opset: Optional[int] = None,
                dynamic_batch: bool = False, input_names: Optional[Sequence[str]] = None,
                output_names: Optional[Sequence[str]] = None, metadata: Optional[dict] = None,
                route: str = DEFAULT_ROUTE) -> onnx.ModelProto:
    """Export a calibrated / trained QAT model as QDQ ONNX and return the ModelProto.

    Contract (details in export/SPEC.md):

    * every active integer / FP8 quantizer on an activation becomes
      ``QuantizeLinear -> DequantizeLinear`` with its trained scale and zero point; on a weight,
      a typed initializer of codes (int8 / int4 / float8 ...) ``-> DequantizeLinear``
      (``axis`` per channel, ``block_size`` per group); BN is folded and 2:4 masks applied;
    * biases of layers with integer input and weight are int32 codes with
      ``scale = s_in * s_w`` (zero point 0), dequantized per channel when the weight is;
    * FP16 / BF16 layers run in that precision between ``Cast`` nodes;
    * the default ``opset`` is the lowest that carries every format in use (13 for INT8, 19 for
      FP8, 21 for INT4 / per-group); an explicit one that cannot carry a quantizer is refused;
    * ``metadata_props`` carry ``dal.version``, ``dal.recipe``, ``dal.hardware``,
      ``dal.requantizer`` and ``dal.sparse_24`` (plus ``metadata``, JSON-encoded when not str);
    * the model is traced in eval mode and left exactly as it was (modes, states, parameters).

    The model may return any nest of tensors (dict, dataclass, HF ``ModelOutput``, lists, tuples,
    ``None`` and other non-tensor leaves, which are no outputs): one graph output per tensor leaf,
    depth-first in ``dal.nest``'s order (dict insertion, dataclass field, sequence position) and
    named by ``dal.nest``: ``output`` (a lone tensor), ``output.0``, ``output.1`` (a tuple),
    ``output.out``, ``output.aux.0`` (``{"out": t, "aux": [t2]}``). Inputs are ``input``
    (``input_0``, ... for several), unless ``input_names`` / ``output_names`` (one per leaf) say otherwise.

    ``route``: ``"torchscript"`` (default), ``"dynamo"`` (torch.export) or ``"auto"`` (dynamo, else
    TorchScript); ``dal.export_route`` / ``dal.export_route_reason`` record it (export/routes.py).

    Raises ExportError for quantizers still observing, quantizers the exporter cannot place,
    or an opset too low; each error lists every offender.

    Example:
        >>> proto = dal.export_onnx(model, (torch.randn(1, 3, 64, 64),), "model.onnx")
    """
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    # A detector exports its NPU part (backbone + heads); pre/post-processing stays on the host (SPEC.md §7a).
    detector, model = model, npu_part(model)
    check_attention_mask(model, args)  # a 2-D HF padding mask would trace as int64 compare arithmetic
    if model is not detector:
        check_batch(args[0] if len(args) == 1 else args, "export_onnx(detector, (batch,)): the batch")
    plan = make_plan(model)
    explicit = opset is not None
    opset = plan.resolve_opset(opset)
    names_in = list(input_names) if input_names else (["input"] if len(args) == 1 else
                                                      [f"input_{k}" for k in range(len(args))])
    names_out = list(output_names) if output_names else None
    traced, route_record = try_dynamo(route, model, args, plan, opset, names_in, names_out, dynamic_batch)
    if traced is not None:
        proto, sites, leaf_names = traced
    else:
        proto, sites, leaf_names, opset = _trace_torchscript(model, args, plan, opset, explicit, names_in, names_out,
                                                             dynamic_batch)
    graph = Graph(proto)
    fold_constants(graph)
    rewrite_float_casts(graph, sites)
    infos = rewrite_scaled(graph, sites)
    rewrite_biases(graph, infos)
    left = [n.name for n in graph.nodes if is_placeholder(n) or n.domain == PLACEHOLDER_DOMAIN]
    if left:
        raise ExportError(f"the exporter could not place {len(left)} quantizer node(s): {left}")
    graph.finish()
    if not output_names:
        _name_outputs(proto, (getattr(model, "output_names", None) if model is not detector else None) or leaf_names)
    _set_opset(proto, opset)
    metadata = {**(metadata or {}), **route_record}
    boundary = boundary_json(detector, model)
    if boundary is not None:
        metadata = {**metadata, "dal.boundary": boundary}
    write_metadata(proto, detector, infos, metadata)
    proto.producer_name, proto.producer_version = "dal", _version()
    check_no_float64_quantize(proto)  # before the checker, whose message names neither the layer nor the cause
    onnx.checker.check_model(proto, full_check=True)
    check_bias_codes(proto)  # saturated int32 biases: named here, not as an overflow on the chip
    if path is not None:
        onnx.save(proto, os.fspath(path))
    return proto


def _trace_torchscript(model, args, plan, opset, explicit, names_in, names_out, dynamic_batch):
    """trace.py's ``(proto, sites, leaf names)`` and the opset traced at: the formats decide the
    default opset, but the float graph may need a newer one (scaled_dot_product_attention: 14);
    torch says which, and an implicit opset is retried once at that one."""
    try:
        with _held_stdout(enabled=not explicit):
            return (*trace(model, args, plan, opset, names_in, names_out, dynamic_batch), opset)
    except ExportError as err:
        needed = _opset_torch_asks_for(err)
        if explicit or needed is None or needed <= opset:
            raise
        return (*trace(model, args, plan, needed, names_in, names_out, dynamic_batch), needed)


class _Held:
    def __init__(self):
        self.text, self.keep = b"", True

    def discard(self):
        self.keep = False


@contextlib.contextmanager
def _held_stdout(enabled: bool):
    """Hold what is written to file descriptor 1 while tracing at a guessed opset.

    torch's TorchScript exporter dumps the whole IR graph to stdout (from C++) when a trace
    fails, whether or not logging was asked for; before a retry at the opset torch names, that
    dump is noise. Anything else written meanwhile (the model's own prints) is written back.
    """
    held = _Held()
    if not enabled:
        yield held
        return
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield held
        except ExportError as err:
            if _opset_torch_asks_for(err) is not None:
                held.discard()  # torch's IR dump of the failed attempt: noise, a retry follows
            raise
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            if held.keep:
                tmp.seek(0)
                text = tmp.read()
                if text:
                    sys.stdout.write(text.decode(errors="replace"))
                    sys.stdout.flush()


def _opset_torch_asks_for(err: ExportError) -> Optional[int]:
    cause = err.__cause__
    if type(cause).__name__ != "UnsupportedOperatorError":
        return None
    found = re.search(r"added in (?:opset |version )?(\d+)", str(cause))
    return int(found.group(1)) if found and int(found.group(1)) <= TRACE_MAX_OPSET else None


def _name_outputs(proto: onnx.ModelProto, names: Optional[list] = None) -> None:
    """Name the graph outputs ``names`` (dal.nest's names of the output's tensor leaves, or a
    detector NPU part's head names) instead of the numbers torch gives them (``375``); without
    names, ``output`` (one) or ``output.0``, ``output.1``, ... (several). A name already in use,
    or an output that is a graph input passed through, is left as it is."""
    g = proto.graph
    inputs = {i.name for i in g.input}
    used = inputs | {t.name for t in g.initializer} | {x for n in g.node for x in (*n.input, *n.output)}
    new = ["output"] if len(g.output) == 1 else [f"output.{k}" for k in range(len(g.output))]
    if names and len(names) == len(g.output):
        new = list(names)
    rename = {o.name: name for o, name in zip(g.output, new) if o.name not in inputs and name not in used}
    for node in g.node:
        node.input[:] = [rename.get(x, x) for x in node.input]
        node.output[:] = [rename.get(x, x) for x in node.output]
    for item in (*g.output, *g.initializer):
        item.name = rename.get(item.name, item.name)


def _set_opset(proto: onnx.ModelProto, opset: int) -> None:
    if opset > TRACE_MAX_OPSET:
        changed = sorted({n.op_type for n in proto.graph.node} & _CHANGED_AFTER_20)
        if changed:
            raise ExportError(f"opset={opset}: {changed} changed meaning after opset {TRACE_MAX_OPSET}, the newest "
                              f"torch traces; export with opset<={TRACE_MAX_OPSET} or without these operators")
    kept = [o for o in proto.opset_import if o.domain not in ("", "ai.onnx", PLACEHOLDER_DOMAIN)]
    del proto.opset_import[:]
    proto.opset_import.add(domain="", version=opset)
    proto.opset_import.extend(kept)
    # IR version: onnx's own table for the opset (opset 21 needs IR 10 for int4 element types).
    proto.ir_version = max(proto.ir_version, onnx.helper.find_min_ir_version_for([proto.opset_import[0]]))


def _version() -> str:
    from .. import __version__

    return __version__
