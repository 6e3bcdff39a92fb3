"""The shape of every value of an exported ONNX graph, for the graph-side cost model.

:func:`infer_shapes` runs ``onnx.shape_inference`` with data propagation (without it when that
fails). A shape the graph computes from another one is not always followed: ``flatten(2)``
exports ``Reshape(x, Concat(Slice(Shape(x), 0, 2), [-1]))``, and onnx propagates no data
through that ``Slice`` of ``Constant`` outputs, so the Reshape's output and everything after it
have no shape. When some value is left without one, the graph's shape arithmetic is evaluated
with ``onnx.reference`` (the ONNX reference implementation, node by node): ``Shape`` / ``Size``
of a value whose shape is known, ``Constant``, and any node computed from those and small
initializers alone (each input at most :data:`SMALL` elements; a ``DequantizeLinear`` never: a
quantized weight is data to the chip). Each such value read by a node that is not shape
arithmetic is then given to shape inference as an initializer, and inference runs again. The
graph's nodes are not changed: only the shapes are read from that second run.
"""
from __future__ import annotations

import numpy as np

#: the most elements a shape-arithmetic value may have (a shape, a slice bound, an axis list)
SMALL = 64


def _infer(model):
    import onnx

    for data_prop in (True, False):  # data_prop: follow the shapes the graph computes (Shape -> Concat)
        try:
            return onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
        except Exception:  # noqa: BLE001 - without both, shapes come only from what the file declares
            continue
    return model


def shapes_of(model) -> tuple[dict, dict]:
    """(name -> element type, name -> shape) of the values ``model`` declares (value_info,
    inputs, outputs, initializers); a symbolic or unknown dimension counts as 1, a value of
    unknown rank has the shape ``[]``."""
    types, shapes = {}, {}
    g = model.graph
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        t = vi.type.tensor_type
        types[vi.name] = t.elem_type
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
    for t in g.initializer:
        types[t.name], shapes[t.name] = t.data_type, list(t.dims)
    return types, shapes


def _exact_shape(model, name):
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                return [d.dim_value for d in dims]
    init = next((t for t in model.graph.initializer if t.name == name), None)
    return list(init.dims) if init is not None else None


def _shape_values(model) -> dict:
    """name -> numpy value of the graph's shape arithmetic (module docstring)."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    opsets = {o.domain: o.version for o in model.opset_import if o.domain in ("", "ai.onnx")}
    inits = {t.name: t for t in model.graph.initializer}
    vals: dict = {}

    def value(name):
        if name in vals:
            return vals[name]
        t = inits.get(name)
        if t is not None and np.prod(t.dims, dtype=np.int64) <= SMALL:
            vals[name] = numpy_helper.to_array(t)
            return vals[name]
        return None

    for node in model.graph.node:
        ins = [i for i in node.input if i]
        if node.domain not in ("", "ai.onnx") or node.op_type == "DequantizeLinear" \
                or any(a.g.node or a.graphs for a in node.attribute):
            continue
        if node.op_type in ("Shape", "Size"):
            shape = _exact_shape(model, node.input[0])
            if shape is None:
                continue
            if node.op_type == "Size":
                vals[node.output[0]] = np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
                continue
            start = next((a.i for a in node.attribute if a.name == "start"), 0)
            end = next((a.i for a in node.attribute if a.name == "end"), len(shape))
            vals[node.output[0]] = np.array(shape[start:end], dtype=np.int64)
            continue
        feeds = {i: value(i) for i in ins}
        if (not ins and node.op_type != "Constant") or any(v is None or np.size(v) > SMALL for v in feeds.values()):
            continue
        try:
            outs = ReferenceEvaluator(node, opsets=opsets).run(None, feeds)
        except Exception:  # noqa: BLE001 - an op the reference cannot run stays unevaluated
            continue
        for name, out in zip(node.output, outs):
            if np.size(out) <= SMALL:
                vals[name] = np.asarray(out)
    return vals


def infer_shapes(model):
    """``model`` with the shapes of its values in ``value_info`` (module docstring): onnx's
    inference, then, when a value is left without a shape, inference again with the graph's
    evaluated shape arithmetic as initializers (the returned model then holds those extra
    initializers; its nodes read the originals' names, so only its shapes should be used)."""
    from onnx import numpy_helper

    model = _infer(model)
    g = model.graph
    ranked = {vi.name for vi in list(g.value_info) + list(g.input) + list(g.output)
              if vi.type.tensor_type.HasField("shape")}
    if all(o in ranked or not o for n in g.node for o in n.output):
        return model
    vals = _shape_values(model)
    computed = {o for n in model.graph.node for o in n.output if o in vals}
    patched = type(model)()
    patched.CopyFrom(model)
    added = set()
    for node in patched.graph.node:
        if any(o in vals for o in node.output):
            continue  # shape arithmetic itself
        for k, name in enumerate(node.input):
            if name in computed:
                alias = f"{name}::dal_shape_value"
                if alias not in added:
                    patched.graph.initializer.append(numpy_helper.from_array(vals[name], alias))
                    added.add(alias)
                node.input[k] = alias
    return _infer(patched) if added else model
