"""Plain float formats (FP16, BF16) -> Casts, with the layer's operator itself in that precision.

An FP16 fallback layer trains as ``fq16(op(fq16(x), fq16(W), b))``. It is written as

    x -> Cast(to=float16) -> op(., W16, b16) [-> Relu/Clip/Add-bias in float16] -> Cast(to=float)

so a deployment compiler sees the precision that was trained: weights and biases are float16
initializers, the operator's element type is float16, and one Cast returns to float32 at the
layer's output quantizer. A float-format placeholder that is not part of such a region becomes
a round trip ``Cast(to=float16) -> Cast(to=float)`` (numerically the fake quantizer).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from .graph import Graph
from .qdq import is_placeholder, site_of
from .trace import Site

#: operators run in the reduced precision when all their float inputs are in it
HALF_OPS = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Sub", "Mul", "Concat"}
#: operators a region extends through (the fused activation, a bias Add) before the output cast
HALF_TAIL_OPS = {"Relu", "Clip", "Add", "Sub", "Mul", "LeakyRelu", "Sigmoid", "Tanh"}


def rewrite_float_casts(graph: Graph, sites: dict[int, Site]) -> None:
    producers = graph.producers()
    consumers = graph.consumers()
    ph = {n.output[0]: n for n in graph.nodes
          if is_placeholder(n) and not site_of(n, sites).quantizer.fmt.is_scaled}
    if not ph:
        return
    const_of = {}  # placeholder output -> constant value (weights), else absent

    def const(name):
        if name not in const_of:
            const_of[name] = graph.const(name, producers)
        return const_of[name]

    def ph_const(name):
        """(placeholder, perm) when ``name`` is a float placeholder on a constant, possibly transposed."""
        node = producers.get(name)
        perm = None
        if node is not None and node.op_type == "Transpose" and len(consumers.get(node.output[0], [])) == 1:
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            perm = tuple(perm[0]) if perm else None
            name = node.input[0]
        p = ph.get(name)
        if p is not None and const(p.input[0]) is not None and len(consumers.get(name, [])) == 1:
            return p, perm, node if perm is not None else None
        return None

    def input_kind(name, fmt):
        """'act' (a placeholder on an activation), 'weight', 'const' (float constant) or None."""
        p = ph.get(name)
        if p is not None and site_of(p, sites).quantizer.fmt == fmt:
            return "act" if const(p.input[0]) is None else "weight"
        w = ph_const(name)
        if w is not None and site_of(w[0], sites).quantizer.fmt == fmt:
            return "weight"
        value = const(name)
        if value is not None and value.dtype == np.float32:
            return "const"
        return None

    half_casts = {}   # (source tensor, elem type) -> its cast name
    new_after = {}    # id(node) -> nodes to insert after it
    new_before = {}
    replaced = set()  # placeholders fully handled

    def cast_in(src, fmt, anchor):
        key = (src, fmt.onnx_type)
        if key not in half_casts:
            half_casts[key] = graph.fresh(f"{src}.{fmt.name}")
            new_before.setdefault(id(anchor), []).append(
                graph.make_node("Cast", [src], [half_casts[key]], f"{src}/Cast_{fmt.name}", to=fmt.onnx_type))
        return half_casts[key]

    def half_init(value, base, fmt):
        return graph.add_init(base, value.astype(fmt.numpy_dtype()))

    for node in list(graph.nodes):
        if node.op_type not in HALF_OPS or is_placeholder(node) or len(node.output) != 1:
            continue
        fmts = {site_of(ph[i], sites).quantizer.fmt for i in node.input if i in ph}
        fmts = {f for f in fmts if f.onnx_type != TensorProto.FLOAT}
        if len(fmts) != 1:
            continue
        fmt = fmts.pop()
        kinds = [input_kind(i, fmt) if i else "empty" for i in node.input]
        if "act" not in kinds or None in kinds:
            continue
        # the operator joins the reduced-precision region
        for k, (i, kind) in enumerate(zip(node.input, kinds)):
            if kind == "act":
                node.input[k] = cast_in(ph[i].input[0], fmt, node)
            elif kind == "weight":
                p, perm, tnode = (ph[i], None, None) if i in ph else ph_const(i)
                value = const(p.input[0])
                if perm is not None:
                    value = value.transpose(perm)
                node.input[k] = half_init(value, f"{site_of(p, sites).entry.name}.{fmt.name}", fmt)
                replaced.add(id(p))
            elif kind == "const":
                node.input[k] = half_init(const(i), f"{i}.{fmt.name}", fmt)
        tail, out = node, node.output[0]
        while True:
            users = consumers.get(out, [])
            if len(users) != 1 or out in graph.outputs:
                break
            u = users[0]
            if is_placeholder(u) and site_of(u, sites).quantizer.fmt == fmt:
                # the output quantizer: one Cast back to float is exactly its round trip
                half = graph.fresh(f"{out}.{fmt.name}")
                _rename_output(tail, out, half)
                new_after.setdefault(id(u), []).append(
                    graph.make_node("Cast", [half], [u.output[0]], f"{u.name}/Cast_float", to=TensorProto.FLOAT))
                replaced.add(id(u))
                tail = None
                break
            others = [i for i in u.input if i and i != out]
            if u.op_type not in HALF_TAIL_OPS or len(u.output) != 1 or any(input_kind(i, fmt) != "const"
                                                                          for i in others):
                break
            for k, i in enumerate(u.input):
                if i and i != out:
                    u.input[k] = half_init(const(i), f"{i}.{fmt.name}", fmt)
            tail, out = u, u.output[0]
        if tail is not None:  # the region ends without an output quantizer: cast back here
            half = graph.fresh(f"{out}.{fmt.name}")
            _rename_output(tail, out, half)
            new_after.setdefault(id(tail), []).append(
                graph.make_node("Cast", [half], [out], f"{tail.name}/Cast_float", to=TensorProto.FLOAT))
    # every other float placeholder: a round trip through the format (or nothing for fp32)
    consumers = graph.consumers()
    nodes = []
    for node in graph.nodes:
        nodes.extend(new_before.get(id(node), []))
        if is_placeholder(node) and id(node) not in replaced and node.output[0] in ph:
            fmt = site_of(node, sites).quantizer.fmt
            x, y = node.input[0], node.output[0]
            if consumers.get(y) or y in graph.outputs:
                if fmt.onnx_type == TensorProto.FLOAT:
                    nodes.append(graph.make_node("Identity", [x], [y], f"{node.name}/Identity"))
                else:
                    half = half_casts.get((x, fmt.onnx_type))
                    if half is None:
                        half = graph.fresh(f"{x}.{fmt.name}")
                        nodes.append(graph.make_node("Cast", [x], [half], f"{node.name}/Cast_{fmt.name}",
                                                     to=fmt.onnx_type))
                    nodes.append(graph.make_node("Cast", [half], [y], f"{node.name}/Cast_float",
                                                 to=TensorProto.FLOAT))
        elif not (is_placeholder(node) and id(node) in replaced):
            nodes.append(node)
        nodes.extend(new_after.get(id(node), []))
    graph.nodes = nodes


def _rename_output(node: onnx.NodeProto, old: str, new: str) -> None:
    for k, o in enumerate(node.output):
        if o == old:
            node.output[k] = new

