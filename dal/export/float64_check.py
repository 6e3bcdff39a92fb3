"""No QuantizeLinear on a float64 tensor: refuse naming the quantizer and where float64 came from.

ONNX QuantizeLinear does not take float64 (onnx's checker: "x typestr: T1, has unsupported type:
tensor(double)"), and a float64 tensor before a quantizer means the file does not compute what the
trained model computed in float32 there: a symbolic of the TorchScript exporter computed in double
and the exporter's type promotion spread it (torch's ``linspace`` did, before dal's own symbolic,
export/symbolics.py), or the model itself quantizes a float64 tensor. Neither is quantized silently
(a Cast to float32 would round a value the QAT model never rounded): the export is refused, naming
each quantizer and the float64 node(s) nearest the graph's inputs on its input's path, which is
where to look (a ``.float()`` in the model, or a symbolic to report).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto

from .errors import ExportError


def _types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)}
    types.update({i.name: i.data_type for i in g.initializer})
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = a.t.data_type
    return types


def check_no_float64_quantize(proto: onnx.ModelProto) -> None:
    """Raise ExportError when a QuantizeLinear's input is float64 (module docstring); the message
    names every such quantizer (the node name less ``/QuantizeLinear``) and the float64 origins
    (float64 nodes none of whose inputs is float64) upstream of it."""
    types = _types(proto)
    double = TensorProto.DOUBLE
    bad = [n for n in proto.graph.node if n.op_type == "QuantizeLinear" and types.get(n.input[0]) == double]
    if not bad:
        return
    producers = {o: n for n in proto.graph.node for o in n.output}
    lines = []
    for q in bad:
        origins, seen, todo = [], set(), [q.input[0]]
        while todo:
            name = todo.pop()
            node = producers.get(name)
            if name in seen or node is None:
                continue
            seen.add(name)
            up = [i for i in node.input if i and types.get(i) == double]
            if not up:
                origins.append(f"{node.name or node.output[0]} ({node.op_type})")
            todo.extend(up)
        where = q.name[:-len("/QuantizeLinear")] if q.name.endswith("/QuantizeLinear") else q.name
        lines.append(f"{where}: its input {q.input[0]!r} is float64; float64 starts at "
                     f"{', '.join(sorted(origins)) or 'a graph input'}")
    raise ExportError(
        f"{len(bad)} quantizer(s) would quantize a float64 tensor: ONNX QuantizeLinear does not take "
        "float64, and dal does not cast it to float32 silently (a rounding the trained model does not have). "
        "Compute that tensor in float32 in the model (or keep the quantizer off with a recipe skip rule):\n  "
        + "\n  ".join(lines))
