"""The layers of an exported QDQ ONNX file as the cost model sees them, read from the graph alone.

Shapes come from ``onnx.shape_inference`` with data propagation (a shape the graph computes,
``F.interpolate``'s ``Shape -> Concat``, is followed), and where that leaves a value without one
(``flatten(2)``'s ``Shape -> Slice -> Concat``), from the graph's shape arithmetic evaluated by
``onnx.reference`` (:mod:`dal.cost.onnx_shapes`); a dimension still symbolic counts as 1. Formats come from
the element types: a compute node's input produced by a ``DequantizeLinear`` runs in the type
that DQ reads (``uint8``, ``int4``, ``float8e4m3fn``...); a ``float16`` tensor is FP16; a float32
input not produced by a DQ is a float op (FP16 where the hardware runs that op class in FP16,
else off the NPU), except for ops exact on integer codes (max pool), which take the format of
the layer before them, as in ``dal.cost.choices``. A node's output feeding a QuantizeLinear
is stored in that Q's type, else in its input format. 2:4 weights are those whose codes have at
most 2 non-zero values in every group of 4 along the reduction axis (checked on the codes).

Which node types are layers, and of which op class, comes from the op registry: a node type
belongs to an op of :mod:`dal.ops` (its ``onnx`` field), and that op's ``cost`` says whether it is
a matrix layer, a vector layer or free (``dal.cost.op_costs.onnx_node_ops``); vector ops exact on
codes (``handling="passthrough"``) are the ones that take the format of the layer before them.
A vector node's input elements are those of its data inputs: initializers, ``Constant`` outputs
and shape arithmetic (``Shape`` and whatever is computed from shapes and constants alone,
:meth:`_Graph.constants`) are not counted, and a vector node computed from them alone is no
layer, as ``dal.cost.torch_graph`` does not charge a call on constants.

Several nodes that one module exported and the chip runs as one operation are one layer
(:mod:`dal.cost.onnx_patterns`): a gated activation (SiLU's ``Mul(x, Sigmoid(x))``,
HardSwish's ``Mul(x, HardSigmoid(x))``, GELU's Erf form), a decomposed RMSNorm / LayerNorm, and
an embedding's ``Gather`` of a 2-D table, a 3-D ``Linear``'s ``MatMul`` and bias ``Add``; each
is charged as the traced model charges its module.

Layer names are the module paths dal's exporter writes into Q/DQ node names
(``stem.0.weight_quant/DequantizeLinear`` -> ``stem.0``), else the ONNX node name; a name
met again is ``name#2``, ``name#3``... (formats are looked up by name). Node types
and MAC counts follow ``dal.cost.torch_graph``:

    Conv           out.numel() * prod(W.shape[1:])            (W: [C_out, C_in/g, k...])
    ConvTranspose  in.numel()  * prod(W.shape[1:])            (W: [C_in, C_out/g, k...])
    Gemm, MatMul   out.numel() * K
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from ..formats import FP16, get_format
from .onnx_patterns import Pattern, bias_adds, find_patterns
from .onnx_shapes import infer_shapes, shapes_of
from .op_costs import onnx_classes, onnx_passthrough
from .roofline import Choice, LayerGeom

ELEM_FORMATS = {2: "uint8", 3: "int8", 5: "int16", 10: "fp16", 17: "fp8_e4m3", 19: "fp8_e5m2", 21: "uint4", 22: "int4"}


class _Graph:
    def __init__(self, path):
        import onnx

        model = onnx.load(str(path))
        self.types, self.shapes = shapes_of(infer_shapes(model))
        self.meta = {p.key: p.value for p in model.metadata_props}
        g = model.graph
        self.nodes = list(g.node)
        self.inits = {t.name: t for t in g.initializer}
        self.outputs = {o.name for o in g.output}
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def constants(self) -> set:
        """Values computed without the graph's data: initializers, ``Constant`` outputs, ``Shape`` /
        ``Size`` outputs (the exporter keeps shape arithmetic, which a fixed-size model does before
        it runs), and the outputs of any node but a ``DequantizeLinear`` (a quantized constant
        operand keeps its format) whose inputs are all constants."""
        const = set(self.inits)
        for n in self.nodes:  # topological order
            ins = [i for i in n.input if i]
            if n.op_type in ("Constant", "Shape", "Size") or (
                    n.op_type != "DequantizeLinear" and ins and all(i in const for i in ins)):
                const.update(n.output)
        return const

    def numel(self, name: str) -> int:
        return math.prod(self.shapes.get(name, [0])) if name in self.shapes else 0

    def dq_source(self, name: str):
        """(DQ node, format) when ``name`` is produced by a DequantizeLinear, else (None, None)."""
        node = self.producer.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            return None, None
        fmt = ELEM_FORMATS.get(self.types.get(node.input[0]))
        return node, get_format(fmt) if fmt else None

    def fmt(self, name: str):
        node, fmt = self.dq_source(name)
        if node is not None:
            return fmt
        return FP16 if self.types.get(name) == 10 else None

    def weight_codes(self, name: str) -> Optional[np.ndarray]:
        from onnx import numpy_helper

        node, _ = self.dq_source(name)
        src = node.input[0] if node is not None else name
        t = self.inits.get(src)
        return numpy_helper.to_array(t) if t is not None else None

    def sparse_axis(self, name: str) -> int:
        """The reduction axis the exporter recorded for these codes (``dal.sparse_24``), else 1."""
        import json

        node, _ = self.dq_source(name)
        src = node.input[0] if node is not None else name
        return int(json.loads(self.meta.get("dal.sparse_24") or "{}").get(src, 1))

    def out_fmt(self, name: str):
        qs = [n for n in self.consumers.get(name, []) if n.op_type == "QuantizeLinear"]
        if len(qs) == 1:
            fmt = ELEM_FORMATS.get(self.types.get(qs[0].output[0]))
            return get_format(fmt) if fmt else None
        return None


def _layer_name(g: _Graph, node, weight: Optional[str]) -> str:
    for src in ([weight] if weight else []) + list(node.input):
        dq, _ = g.dq_source(src) if src else (None, None)
        if dq is not None and "/" in dq.name:
            base = dq.name.split("/")[0]
            for suffix in (".weight_quant", ".input_quant", ".input_quants.0", ".input_quants.1", ".bias"):
                if base.endswith(suffix):
                    return base[: -len(suffix)]
    return scope_path(node.name) or f"{node.op_type}_{node.output[0]}"


def scope_path(node_name: str) -> str:
    """The module path in a TorchScript-exported node name: ``/model/layer1/layer1.0/conv1/Conv``
    -> ``layer1.0.conv1`` (each scope is either the full path so far or one more attribute)."""
    parts = node_name.strip("/").split("/")[1:-1]
    if not parts:
        return node_name
    path = parts[0]
    for part in parts[1:]:
        path = part if part.startswith(path + ".") else f"{path}.{part}"
    return path


def is_24(codes: Optional[np.ndarray], axis: int = 1) -> bool:
    """At most 2 non-zero values in every group of 4 consecutive elements along ``axis``."""
    if codes is None or codes.ndim < 2 or codes.shape[axis] % 4:
        return False
    moved = np.moveaxis(np.asarray(codes).astype(np.float32) != 0, axis, -1)
    return bool((moved.reshape(-1, 4).sum(-1) <= 2).all())


def _matrix(g: _Graph, node, op_class: str, out: str):
    x, w = node.input[0], node.input[1]
    unknown = [v for v in (x, w, out) if not g.shapes.get(v)]
    if unknown:
        raise ValueError(f"dal.estimate: {node.op_type} node {node.name!r}: the shape of {', '.join(unknown)} is "
                         "unknown (onnx shape inference did not follow the graph's shape arithmetic); estimate the "
                         "prepared model instead, or export with shapes the graph states (a reshape to constants)")
    wshape = g.shapes.get(w, [])
    weighted = g.weight_codes(w) is not None or w in g.inits
    if op_class == "matmul" and weighted:
        op_class = "linear"
    if op_class == "conv":
        macs, cin, cout = g.numel(out) * math.prod(wshape[1:]), g.shapes[x][1], wshape[0]
    elif op_class == "conv_transpose":
        macs, cin, cout = g.numel(x) * math.prod(wshape[1:]), wshape[0], g.shapes[out][1]
    else:
        trans_a = any(a.name == "transA" and a.i for a in node.attribute)
        k = g.shapes[x][-2] if trans_a else g.shapes[x][-1]
        macs, cin, cout = g.numel(out) * k, k, g.shapes[out][-1]
    ins = g.numel(x) + (0 if weighted else g.numel(w))
    geom = LayerGeom(_layer_name(g, node, w if weighted else None), op_class, int(macs),
                     g.numel(w) if weighted else 0, int(ins), g.numel(out), int(cin), int(cout), type_name=node.op_type)
    return geom, (w if weighted else None)


def _float_choice(hw, op_class: str, weighted: bool) -> Optional[Choice]:
    role = "weight" if weighted else "input"
    if hw is None or not hw.supports_op(op_class) or FP16 not in hw.allowed_formats(op_class, role):
        return None
    return Choice(FP16 if weighted else None, FP16, FP16)


def _rounded_fmt(g: _Graph, name: str):
    """The format of ``name``, looking through Casts: a DQ's type, or FP16 where a Cast on the
    way wrote float16 (an FP16 quantizer's round trip), else None."""
    while True:
        fmt = g.fmt(name)
        node = g.producer.get(name)
        if fmt is not None or node is None or node.op_type != "Cast":
            return fmt
        name = node.input[0]


def _pattern_layer(g: _Graph, hw, p: Pattern, node):
    """(geometry, Choice) of a several-node layer (:mod:`dal.cost.onnx_patterns`), as
    ``dal.cost.torch_graph`` / ``dal.cost.choices`` charge the module that wrote it: an
    activation as a vector node; a normalisation in its input's and weight's formats (looking
    through an FP16 island's Casts), no weight elements (the traced model charges none for a
    norm); an embedding with no MACs and no input elements, its output's elements read from the
    table, in the table's format."""
    out = g.numel(p.out)
    if p.op_class == "embedding":
        geom = LayerGeom(_layer_name(g, node, p.weight), "embedding", 0, out, 0, out, type_name=node.op_type)
        w = g.fmt(p.weight)
        if w is not None:
            return geom, Choice(w, None, g.out_fmt(p.out) or w)
        fp16 = (hw is not None and hw.supports_op("embedding")
                and FP16 in hw.allowed_formats("embedding", "output"))
        return geom, Choice(FP16, None, FP16) if fp16 else None
    first = g.nodes[min(p.members)]
    geom = LayerGeom(_layer_name(g, first, None), p.op_class, 0, 0, g.numel(p.x), out, function=p.function,
                     type_name=first.op_type)
    if p.op_class == "layernorm":
        x = _rounded_fmt(g, p.x)
        w = _rounded_fmt(g, p.weight) if p.weight else None
        if x is None and w is None:
            return geom, _float_choice(hw, p.op_class, False)
        return geom, Choice(w, x or w, g.out_fmt(p.out) or x or w)
    x, y = g.fmt(p.x), g.out_fmt(p.out)
    if x is not None:
        return geom, Choice(None, x, y or x, lut=_lookup(g, p.op_class, p.x, y))
    return geom, _float_choice(hw, p.op_class, False)


def _lookup(g: _Graph, op_class: str, x: str, y) -> bool:
    """An activation from codes (a DequantizeLinear of an integer or FP8 type) to a
    QuantizeLinear runs as a lookup table: dal's one activation with quantizers of its own is
    ``QLutActivation`` (export/SPEC.md §6 ``lut_activation``), which ``dal.cost.choices`` times
    as a lookup."""
    dq, fmt = g.dq_source(x)
    return op_class == "activation" and dq is not None and y is not None and fmt is not None and fmt.is_scaled


def onnx_layers(path, hardware=None):
    """(geometries, name -> Choice, the file's ``dal.hardware`` metadata or None) of an ONNX file."""
    from ..hardware import load_hardware

    g = _Graph(path)
    meta_hw = g.meta.get("dal.hardware") or None
    hw = load_hardware(hardware if hardware is not None else meta_hw) if (hardware or meta_hw) else None
    geoms, choices, previous, seen = [], {}, None, {}
    matrix_ops, vector_ops, passthrough = onnx_classes("matrix"), onnx_classes("vector"), onnx_passthrough()
    const = g.constants()
    patterns = {p.anchor: p for p in find_patterns(g, const)}
    biases = bias_adds(g, const, matrix_ops)
    inside = set().union(*(p.members for p in patterns.values()), biases.values())
    for i, node in enumerate(g.nodes):
        if i in patterns:
            geom, choice = _pattern_layer(g, hw, patterns[i], node)
        elif i in inside:
            continue
        elif node.op_type in matrix_ops:
            out = g.nodes[biases[i]].output[0] if i in biases else node.output[0]
            geom, w = _matrix(g, node, matrix_ops[node.op_type], out)
            x = g.fmt(node.input[0])
            wf = g.fmt(w) if w is not None else None
            if x is None and wf is None:
                choice = _float_choice(hw, geom.op_class, w is not None)
            else:
                x = x or wf
                sparse = (w is not None and hw is not None and hw.supports_sparsity(geom.op_class, "2:4")
                          and is_24(g.weight_codes(w), g.sparse_axis(w)))
                choice = Choice(wf, x, g.out_fmt(out) or x, sparse=sparse)
        elif node.op_type in vector_ops:
            op_class = vector_ops[node.op_type]
            data = [i for i in node.input if i and i not in const]
            if not data:  # shape arithmetic or a constant the exporter did not fold: no layer
                continue
            geom = LayerGeom(_layer_name(g, node, None), op_class, 0, 0, sum(g.numel(i) for i in data),
                             g.numel(node.output[0]), type_name=node.op_type)
            x = next((f for f in (g.fmt(i) for i in data) if f is not None), None)
            if x is not None:
                y = g.out_fmt(node.output[0])
                choice = Choice(None, x, y or x, lut=_lookup(g, op_class, data[0], y))
            elif node.op_type in passthrough and previous is not None:
                choice = Choice(None, previous.output, previous.output)
            else:
                choice = _float_choice(hw, op_class, False)
        else:
            continue
        seen[geom.name] = seen.get(geom.name, 0) + 1
        if seen[geom.name] > 1:  # a second layer of the same name (a Linear's MatMul and Add scope): name#2
            geom = dataclasses.replace(geom, name=f"{geom.name}#{seen[geom.name]}")
        geoms.append(geom)
        choices[geom.name] = choice
        if choice is not None:
            previous = choice
    return geoms, choices, meta_hw
