"""Trace the model to ONNX through ``torch.export`` and the dynamo ONNX exporter, placeholders and all.

The same contract as :func:`dal.export.trace.trace` (the TorchScript route): ``(proto, sites, leaf
names)``, every active quantizer call one ``dal::Q(x){site=k}`` node, so that the ``rewrite_*``
passes run unchanged on either graph. Here the placeholder is a ``torch.library`` custom op
``dal::q_site(x, site)`` (the identity, eager and fake) that ``torch.export.export(strict=False)``
records, and an onnxscript translation of it (``custom_translation_table``) writes the ``dal::Q``
node. The exporter's optimizer (onnxscript's constant folding and rewrite rules, :func:`_optimize`)
folds what is computed from parameters (BN folding, masks, the int32 fake quantization of biases)
into initializers; dal's fold.py folds what it leaves.

Opsets: the dynamo exporter writes opset 18 and newer. A file asked for at an older opset (13 for
INT8) is traced at 18 and taken down before the rewrites (:func:`_down_to`: ``onnx.version_converter``
has no down adapters for most operators): where an operator's schema moved ``axes`` from an
attribute to a constant input (``ReduceMean`` at 18), the input goes back to the attribute; an
attribute the older schema lacks is dropped when it holds the newer schema's default (``Reshape``'s
``allowzero=0``, ``Resize``'s ``antialias=0``); ``HardSwish`` (opset 14) below 14 becomes what
TorchScript writes there, ``Mul(x, HardSigmoid(x, alpha=1/6))``; every
standard node must then pass ``onnx.checker.check_node`` at the older opset, or the trace is a
:class:`CaptureError` like a failed capture.

dal/export/dynamo_ops.py translates the operators the exporter would otherwise write differently
from the TorchScript route (``GlobalAveragePool``, ``Flatten``).

:class:`CaptureError` says torch.export or the dynamo exporter could not capture the model
(data-dependent control flow, detection post-processing, an operator without translation):
``route="auto"`` then takes the TorchScript route (dal/export/routes.py).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import onnx
import torch
from torch import nn

from ..nn.modes import eval_mode
from .dynamo_ops import KeepFlatten, translations
from .errors import ExportError
from .plan import ExportPlan
from .trace import PLACEHOLDER_DOMAIN, PLACEHOLDER_OP, Site, flat_outputs, placeholders

#: the oldest opset the dynamo exporter writes natively
DYNAMO_MIN_OPSET = 18
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]


class CaptureError(ExportError):
    """torch.export or the dynamo ONNX exporter could not capture the model; ``reason`` is one line."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@functools.cache
def site_op():
    """``torch.ops.dal.q_site.default``: ``q_site(x, site) -> x`` (a copy), registered on first use."""

    @torch.library.custom_op("dal::q_site", mutates_args=())
    def q_site(x: torch.Tensor, site: int) -> torch.Tensor:
        return x.clone()

    @q_site.register_fake
    def _fake(x, site):
        return torch.empty_like(x)

    return torch.ops.dal.q_site.default


@functools.cache
def translation_table() -> dict:
    """``{dal::q_site: onnxscript function}`` writing ``dal::Q(x){site=k}`` (the schema is local,
    not registered with onnx: no ``dal`` node survives the rewrites)."""
    import onnxscript
    from onnx.defs import OpSchema

    schema = OpSchema(PLACEHOLDER_OP, PLACEHOLDER_DOMAIN, 1,
                      inputs=[OpSchema.FormalParameter("x", "T")], outputs=[OpSchema.FormalParameter("y", "T")],
                      type_constraints=[("T", _FLOAT_TYPES, "the quantized tensor's float type")],
                      attributes=[OpSchema.Attribute("site", OpSchema.AttrType.INT, "the call site's index")])
    placeholder = onnxscript.values.Op(onnxscript.values.Opset(PLACEHOLDER_DOMAIN, 1), PLACEHOLDER_OP, schema)

    def q_site(x, site: int):
        return placeholder(x, site=site)

    return {site_op(): q_site}


def _hint(d) -> int:
    """A traced dimension as the example's int (a symbolic batch keeps its example value)."""
    node = getattr(d, "node", None)
    return int(node.hint) if node is not None and node.hint is not None else int(d)


def _reason(exc: BaseException) -> str:
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:300]}"


def trace_dynamo(model: nn.Module, args: tuple, plan: ExportPlan, opset: int, input_names: list[str],
                 output_names: Optional[list[str]], dynamic_batch: bool
                 ) -> tuple[onnx.ModelProto, dict[int, Site], list[str]]:
    """``torch.export.export(strict=False)`` then ``torch.onnx.export(dynamo=True, optimize=True)``
    with placeholders, in eval mode: ``(proto, sites, leaf names)`` as :func:`dal.export.trace.trace`.

    The graph's opset import is ``opset`` (traced at ``max(opset, 18)``, converted down when
    older). ``dynamic_batch``: dimension 0 of every input and output is ``batch``. Raises
    :class:`CaptureError` when either step fails or the batch cannot stay symbolic; the model is
    left as it was either way.
    """
    try:
        table = {**translation_table(), **translations()}
    except ImportError as exc:
        raise CaptureError(f"the dynamo route needs onnxscript ({exc})", f"onnxscript missing: {exc}") from exc
    sites: dict[int, Site] = {}
    leaf_names: list[str] = []
    dynamic = tuple({0: torch.export.Dim.AUTO} for _ in args) if dynamic_batch else None
    name = type(model).__name__
    with eval_mode(model), placeholders(plan, sites, site_op()), flat_outputs(model, leaf_names), \
            torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
        try:
            with KeepFlatten():
                program = torch.export.export(model, args, dynamic_shapes=dynamic, strict=False)
        except Exception as exc:
            raise CaptureError(f"torch.export could not capture {name}: {_reason(exc)}", _reason(exc)) from exc
        try:
            onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=max(opset, DYNAMO_MIN_OPSET),
                                             custom_translation_table=table, optimize=False,
                                             input_names=input_names, output_names=output_names, verbose=False)
        except Exception as exc:
            raise CaptureError(f"the dynamo ONNX exporter could not translate {name}: {_reason(exc)}",
                               _reason(exc)) from exc
        _optimize(onnx_program.model)
    for sid, site in sites.items():
        sites[sid] = Site(site.entry, tuple(_hint(d) for d in site.shape))
    proto = onnx_program.model_proto
    _clean(proto)
    if dynamic_batch:
        _name_batch(proto, name)
    if opset < DYNAMO_MIN_OPSET:
        _down_to(proto, opset, name)
    if output_names is not None and len(output_names) != len(proto.graph.output):
        raise ExportError(f"output_names: {len(output_names)} name(s) {list(output_names)} for the model's "
                          f"{len(proto.graph.output)} tensor output(s) {leaf_names} (dal.nest order)")
    return proto, sites, leaf_names


def _clean(proto: onnx.ModelProto) -> None:
    """Drop what the dynamo exporter adds beyond the graph: per-node and model metadata (stack
    traces, torch's module names), ``value_info``, doc strings (dal writes its own metadata); and
    ``Reshape``'s ``allowzero=1`` (torch's ``view``: a 0 in the shape is 0) where the shape is a
    constant without 0, where it means what the TorchScript route's ``Reshape`` means."""
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    for node in proto.graph.node:
        if node.op_type == "Reshape" and len(node.input) > 1 and node.input[1] in inits and \
                0 not in numpy_helper.to_array(inits[node.input[1]]).tolist():
            kept = [a for a in node.attribute if not (a.name == "allowzero" and a.i == 1)]
            del node.attribute[:]
            node.attribute.extend(kept)
    del proto.metadata_props[:]
    del proto.graph.value_info[:]
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    proto.graph.doc_string = ""


def _name_batch(proto: onnx.ModelProto, name: str) -> None:
    """Dimension 0 of every input and output: the symbol torch gave the batch, renamed ``batch``."""
    g = proto.graph
    symbols = {i.type.tensor_type.shape.dim[0].dim_param for i in g.input if i.type.tensor_type.shape.dim}
    if "" in symbols or len(symbols) != 1:
        raise CaptureError(f"torch.export specialized {name}'s batch dimension (input dims {sorted(symbols)})",
                           "batch dimension not symbolic")
    symbol = symbols.pop()
    for v in (*g.input, *g.output):
        dims = v.type.tensor_type.shape.dim
        if dims and dims[0].dim_param == symbol:
            dims[0].dim_param = "batch"


def _down_to(proto: onnx.ModelProto, opset: int, name: str) -> None:
    """The graph (traced at opset 18) at ``opset`` < 18, in place (module docstring)."""
    from onnx import checker, defs, helper, numpy_helper

    g = proto.graph
    if opset < 14:
        _hardswish_as_torchscript(g)
    inits = {t.name: t for t in g.initializer}
    ctx = checker.C.CheckerContext()
    ctx.ir_version = proto.ir_version
    ctx.opset_imports = {"": opset}
    for node in g.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            new = defs.get_schema(node.op_type, DYNAMO_MIN_OPSET, "")
            old = defs.get_schema(node.op_type, opset, "")
        except defs.SchemaError as exc:
            raise CaptureError(f"{name}: {node.op_type} has no schema at opset {opset}",
                               f"{node.op_type} not in opset {opset}") from exc
        new_inputs = [i.name for i in new.inputs]
        if "axes" in new_inputs and "axes" in old.attributes and "axes" not in [i.name for i in old.inputs]:
            k = new_inputs.index("axes")
            if len(node.input) > k and node.input[k]:
                if node.input[k] not in inits:
                    raise CaptureError(f"{name}: {node.op_type} {node.name!r} has computed axes; opset {opset} "
                                       "needs them constant", f"{node.op_type} axes not constant")
                axes = numpy_helper.to_array(inits[node.input[k]]).tolist()
                del node.input[k:]
                node.attribute.append(helper.make_attribute("axes", [int(a) for a in axes]))
        _drop_default_attributes(node, new, old)
        try:
            checker.check_node(node, ctx)
        except Exception as exc:
            raise CaptureError(f"{name}: the dynamo graph's {node.op_type} {node.name!r} is not valid at opset "
                               f"{opset}: {_reason(exc)}", f"{node.op_type} not valid at opset {opset}") from exc
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = opset


def _optimize(model) -> None:
    """What ``torch.onnx.export(optimize=True)`` runs (``onnxscript.optimizer.optimize_ir``: inline,
    constant folding, rewrite rules, dead code, constants lifted to initializers, duplicates
    merged), on the ``onnx_ir`` model in place, less two kinds of rewrite rules: ``Flatten ->
    Reshape`` (the TorchScript route writes ``Flatten``: dynamo_ops.py) and the removal of an
    all-zero bias from Conv / Gemm (dal quantizes that bias to int32 codes like any other)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding
    from onnxscript.rewriter.rules.common import _basic_rules, _remove_optional_bias

    dropped = {id(_basic_rules.flatten_to_reshape_rule), *(id(r) for r in _remove_optional_bias.rules)}
    rules = [r for r in rewriter._DEFAULT_REWRITE_RULES if id(r) not in dropped]
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager([_constant_folding.FoldConstantsPass(
            shape_inference=True, input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
            output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT),
            rewriter.RewritePass(rules), common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(),
            common.RemoveUnusedOpsetsPass()], steps=2, early_stop=True),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(model)


def _drop_default_attributes(node, new, old) -> None:
    """Remove from ``node`` each attribute schema ``old`` lacks whose value is schema ``new``'s default."""
    from onnx import helper

    keep = []
    for a in node.attribute:
        default = new.attributes[a.name].default_value if a.name in new.attributes else None
        if a.name not in old.attributes and default is not None and default.type == a.type and \
                helper.get_attribute_value(default) == helper.get_attribute_value(a):
            continue
        keep.append(a)
    if len(keep) != len(node.attribute):
        del node.attribute[:]
        node.attribute.extend(keep)


def _hardswish_as_torchscript(g) -> None:
    """Each ``HardSwish(x)`` node of ``g`` as ``Mul(x, HardSigmoid(x, alpha=1/6, beta=0.5))``, the
    TorchScript exporter's form below opset 14 (torch.onnx symbolic_opset9.hardswish), in place."""
    from onnx import helper

    nodes = []
    for node in g.node:
        if node.op_type != "HardSwish" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        x, y = node.input[0], node.output[0]
        gate = f"{y}.hardsigmoid"
        nodes.append(helper.make_node("HardSigmoid", [x], [gate], name=f"{node.name}.hardsigmoid", alpha=1.0 / 6))
        nodes.append(helper.make_node("Mul", [x, gate], [y], name=node.name))
    del g.node[:]
    g.node.extend(nodes)
