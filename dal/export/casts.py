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

from .. import ops
from .graph import Graph
from .qdq import is_placeholder, site_of
from .trace import Site


def half_ops() -> frozenset:
    """The ONNX node types run in the reduced precision when all their float inputs are in it:
    the ``onnx`` nodes of every registered op whose ``fp16_region`` holds ``"compute"``
    (Conv, ConvTranspose, Gemm, MatMul, Add, Sub, Mul, Concat for dal's own ops)."""
    return frozenset(t for op in ops.all_ops() if "compute" in op.fp16_region for t in op.onnx)


def half_tail_ops() -> frozenset:
    """The ONNX node types a region extends through (the fused activation, a bias Add) before the
    output cast, when their other inputs are constants: the ``onnx`` nodes of every registered op
    whose ``fp16_region`` holds ``"tail"`` (Relu, Clip, LeakyRelu, Sigmoid, Tanh, Add, Sub, Mul)."""
    return frozenset(t for op in ops.all_ops() if "tail" in op.fp16_region for t in op.onnx)


def rewrite_float_casts(graph: Graph, sites: dict[int, Site]) -> None:
    """Rewrite the plain-float placeholders of ``graph`` into Casts (module docstring)."""
    ph = {n.output[0]: n for n in graph.nodes
          if is_placeholder(n) and not site_of(n, sites).quantizer.fmt.is_scaled}
    if not ph:
        return
    rewrite = _HalfRegions(graph, sites, ph, half_ops(), half_tail_ops())
    for node in list(graph.nodes):
        rewrite.try_region(node)
    rewrite.finish()


class _HalfRegions:
    """One pass of :func:`rewrite_float_casts`: the reduced-precision regions, then the rest."""

    def __init__(self, graph: Graph, sites: dict[int, Site], ph: dict, compute: frozenset, tail: frozenset):
        self.graph, self.sites, self.ph = graph, sites, ph
        self.compute, self.tail = compute, tail  # half_ops(), half_tail_ops()
        self.producers = graph.producers()
        self.consumers = graph.consumers()
        self.const_of = {}     # placeholder output -> constant value (weights), else absent
        self.half_casts = {}   # (source tensor, elem type) -> its cast name
        self.new_after = {}    # id(node) -> nodes to insert after it
        self.new_before = {}
        self.replaced = set()  # placeholders fully handled
        self.half_out = {}     # id(placeholder) -> the reduced-precision tensor that closed a region at it

    def fmt_of(self, placeholder):
        return site_of(placeholder, self.sites).quantizer.fmt

    def const(self, name):
        if name not in self.const_of:
            self.const_of[name] = self.graph.const(name, self.producers)
        return self.const_of[name]

    def ph_const(self, name):
        """(placeholder, perm, transpose node) when ``name`` is a float placeholder on a
        constant, possibly transposed; else None."""
        node = self.producers.get(name)
        perm = None
        if node is not None and node.op_type == "Transpose" and len(self.consumers.get(node.output[0], [])) == 1:
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            perm = tuple(perm[0]) if perm else None
            name = node.input[0]
        p = self.ph.get(name)
        if p is not None and self.const(p.input[0]) is not None and len(self.consumers.get(name, [])) == 1:
            return p, perm, node if perm is not None else None
        return None

    def input_kind(self, name, fmt):
        """'act' (a placeholder on an activation), 'weight', 'const' (float constant) or None."""
        p = self.ph.get(name)
        if p is not None and self.fmt_of(p) == fmt:
            return "act" if self.const(p.input[0]) is None else "weight"
        w = self.ph_const(name)
        if w is not None and self.fmt_of(w[0]) == fmt:
            return "weight"
        value = self.const(name)
        if value is not None and value.dtype == np.float32:
            return "const"
        return None

    def cast_in(self, src, fmt, anchor):
        key = (src, fmt.onnx_type)
        if key not in self.half_casts:
            self.half_casts[key] = self.graph.fresh(f"{src}.{fmt.name}")
            self.new_before.setdefault(id(anchor), []).append(self.graph.make_node(
                "Cast", [src], [self.half_casts[key]], f"{src}/Cast_{fmt.name}", to=fmt.onnx_type))
        return self.half_casts[key]

    def half_init(self, value, base, fmt):
        return self.graph.add_init(base, value.astype(fmt.numpy_dtype()))

    def try_region(self, node) -> None:
        """If ``node`` computes in one reduced format, move it (and its tail) into that format."""
        if node.op_type not in self.compute or is_placeholder(node) or len(node.output) != 1:
            return
        if any(getattr(site_of(self.ph[i], self.sites).entry.owner, "fp16_island", False)
               for i in node.input if i in self.ph):
            return  # an FP16 island's op runs in float32 between its round trips (SPEC.md §5a)
        fmts = {self.fmt_of(self.ph[i]) for i in node.input if i in self.ph}
        fmts = {f for f in fmts if f.onnx_type != TensorProto.FLOAT}
        if len(fmts) != 1:
            return
        fmt = fmts.pop()
        kinds = [self.input_kind(i, fmt) if i else "empty" for i in node.input]
        if "act" not in kinds or None in kinds:
            return
        self._join(node, kinds, fmt)
        self._extend_tail(node, fmt)

    def _join(self, node, kinds, fmt) -> None:
        """The operator joins the reduced-precision region: its inputs become casts / initializers."""
        for k, (i, kind) in enumerate(zip(node.input, kinds)):
            if kind == "act":
                p = self.ph[i]
                # a placeholder that already closed an earlier region (two FP16 layers in a row):
                # its source was renamed to that region's half tensor, which this op reads as is;
                # likewise when p reads such a placeholder (an FP16 output quantizer, then the
                # next layer's FP16 input quantizer)
                prev = self.producers.get(p.input[0])
                node.input[k] = (self.half_out.get(id(p)) or self.half_out.get(id(prev))
                                 or self.cast_in(p.input[0], fmt, node))
            elif kind == "weight":
                p, perm, _ = (self.ph[i], None, None) if i in self.ph else self.ph_const(i)
                value = self.const(p.input[0])
                if perm is not None:
                    value = value.transpose(perm)
                node.input[k] = self.half_init(value, f"{site_of(p, self.sites).entry.name}.{fmt.name}", fmt)
                self.replaced.add(id(p))
            elif kind == "const":
                node.input[k] = self.half_init(self.const(i), f"{i}.{fmt.name}", fmt)

    def _extend_tail(self, node, fmt) -> None:
        """Follow the region through its tail ops to the output quantizer, and cast back to float."""
        graph = self.graph
        tail, out = node, node.output[0]
        while True:
            users = self.consumers.get(out, [])
            if len(users) != 1 or out in graph.outputs:
                break
            u = users[0]
            if is_placeholder(u) and self.fmt_of(u) == fmt:
                # the output quantizer: one Cast back to float is exactly its round trip
                half = graph.fresh(f"{out}.{fmt.name}")
                _rename_output(tail, out, half)
                self.new_after.setdefault(id(u), []).append(
                    graph.make_node("Cast", [half], [u.output[0]], f"{u.name}/Cast_float", to=TensorProto.FLOAT))
                self.replaced.add(id(u))
                self.half_out[id(u)] = half
                return
            others = [i for i in u.input if i and i != out]
            if u.op_type not in self.tail or len(u.output) != 1 or any(self.input_kind(i, fmt) != "const"
                                                                          for i in others):
                break
            for k, i in enumerate(u.input):
                if i and i != out:
                    u.input[k] = self.half_init(self.const(i), f"{i}.{fmt.name}", fmt)
            tail, out = u, u.output[0]
        # the region ends without an output quantizer: cast back here
        half = graph.fresh(f"{out}.{fmt.name}")
        _rename_output(tail, out, half)
        self.new_after.setdefault(id(tail), []).append(
            graph.make_node("Cast", [half], [out], f"{tail.name}/Cast_float", to=TensorProto.FLOAT))

    def finish(self) -> None:
        """Every other float placeholder: a round trip through the format (or nothing for fp32).
        A round trip of a tensor that another one of the same format already rounded (an FP16
        island reading an FP16 island's output) is exact and is left out: its readers read
        that tensor."""
        graph = self.graph
        consumers = graph.consumers()
        nodes, alias = [], {}
        for node in graph.nodes:
            nodes.extend(self.new_before.get(id(node), []))
            if is_placeholder(node) and id(node) not in self.replaced and node.output[0] in self.ph:
                if self._rounded_already(node) and node.output[0] not in graph.outputs:
                    alias[node.output[0]] = node.input[0]
                elif consumers.get(node.output[0]) or node.output[0] in graph.outputs:
                    nodes.extend(self._round_trip(node))
            elif not (is_placeholder(node) and id(node) in self.replaced):
                nodes.append(node)
            nodes.extend(self.new_after.get(id(node), []))
        for node in nodes:
            for k, i in enumerate(node.input):
                while i in alias:
                    i = alias[i]
                node.input[k] = i
        graph.nodes = nodes

    def _rounded_already(self, node) -> bool:
        """``node`` (a reduced-precision placeholder) reads the output of a placeholder of the same
        format: its values are already in that format, so the round trip is the identity."""
        p = self.producers.get(node.input[0])
        fmt = self.fmt_of(node)
        return (fmt.onnx_type != TensorProto.FLOAT and p is not None and is_placeholder(p)
                and p.output[0] in self.ph and self.fmt_of(p) == fmt)

    def _round_trip(self, node) -> list:
        """The nodes replacing a float placeholder outside any region."""
        graph, fmt = self.graph, self.fmt_of(node)
        x, y = node.input[0], node.output[0]
        if fmt.onnx_type == TensorProto.FLOAT:
            return [graph.make_node("Identity", [x], [y], f"{node.name}/Identity")]
        out = []
        half = self.half_casts.get((x, fmt.onnx_type))
        if half is None:
            half = graph.fresh(f"{x}.{fmt.name}")
            out.append(graph.make_node("Cast", [x], [half], f"{node.name}/Cast_{fmt.name}", to=fmt.onnx_type))
        out.append(graph.make_node("Cast", [half], [y], f"{node.name}/Cast_float", to=TensorProto.FLOAT))
        return out


def _rename_output(node: onnx.NodeProto, old: str, new: str) -> None:
    for k, o in enumerate(node.output):
        if o == old:
            node.output[k] = new

