"""ONNX model -> constants, topologically sorted nodes, producer/consumer maps.

Only reads the file: no dal code outside dal.npu. Malformed input raises NPUError naming the
culprit (node, tensor or initializer).
"""
from __future__ import annotations

import functools
import os

import numpy as np

from .errors import NPUError, UnsupportedNode
from .tensors import load_initializer


def load_model(model):
    """onnx.ModelProto from a path, bytes or ModelProto (NPUError on unreadable input)."""
    import onnx
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, (bytes, bytearray, memoryview)):
            m = onnx.load_from_string(bytes(model))
        elif isinstance(model, (str, os.PathLike)):
            if not os.path.exists(model):
                raise NPUError(f"model file {os.fspath(model)!r} does not exist")
            m = onnx.load(os.fspath(model))
        else:
            raise NPUError(f"model must be a path, bytes or onnx.ModelProto, not {type(model).__name__}")
    except NPUError:
        raise
    except Exception as e:
        raise NPUError(f"cannot parse the ONNX model: {type(e).__name__}: {e}") from None
    if not m.HasField("graph"):
        raise NPUError("the ONNX model has no graph (truncated or not an ONNX file?)")
    return m


class Graph:
    """Parsed graph: ``consts`` (initializers + Constant nodes), ``nodes`` in topological order."""

    def __init__(self, model):
        from onnx import helper
        self.model = model
        gr = model.graph
        self.opset = 0
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                self.opset = o.version
        if self.opset == 0:
            raise NPUError("the model imports no ai.onnx opset")
        self.consts: dict[str, np.ndarray] = {}
        for t in gr.initializer:
            self.consts[t.name] = load_initializer(t)
        self.inputs = [i.name for i in gr.input if i.name not in self.consts]
        self.input_info = {i.name: i for i in gr.input if i.name not in self.consts}
        self.outputs = [o.name for o in gr.output]
        self._attrs = {}
        self._shapes = {}
        for vi in list(gr.input) + list(gr.value_info) + list(gr.output):
            t = vi.type.tensor_type
            if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
                self._shapes[vi.name] = tuple(d.dim_value for d in t.shape.dim)
        nodes = []
        for i, n in enumerate(gr.node):
            if not n.name:
                n.name = f"{n.op_type}_{i}"  # a name every error message can use
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                self.consts[n.output[0]] = self._constant(n, helper)
            else:
                nodes.append(n)
        self.nodes = self._toposort(nodes)
        self._producer = {o: n for n in self.nodes for o in n.output if o}
        self._consumers: dict[str, list] = {}
        for n in self.nodes:
            for i in n.input:
                if i:
                    self._consumers.setdefault(i, []).append(n)

    def _constant(self, n, helper):
        a = self.attrs(n)
        if "value" in a:
            return load_initializer(a["value"])
        for key, dt in (("value_float", np.float32), ("value_floats", np.float32),
                        ("value_int", np.int64), ("value_ints", np.int64)):
            if key in a:
                return np.array(a[key], dtype=dt)
        raise UnsupportedNode(n, [], "Constant without value/value_float(s)/value_int(s)")

    def _toposort(self, nodes):
        known = set(self.consts) | set(self.inputs) | {""}
        produced = {}
        for n in nodes:
            for o in n.output:
                if o:
                    if o in produced or o in self.consts or o in self.inputs:
                        raise NPUError(f"tensor {o!r} is produced twice (node {n.name!r})")
                    produced[o] = n
        for n in nodes:
            for i in n.input:
                if i not in known and i not in produced:
                    raise NPUError(f"node {n.name!r} ({n.op_type}) reads {i!r}, which is neither a "
                                   "graph input, an initializer nor any node's output")
        order, done, ready = [], set(known), []
        waiting = {id(n): sum(1 for i in set(n.input) if i not in done) for n in nodes}
        users: dict[str, list] = {}
        for n in nodes:
            for i in set(n.input):
                if i not in done:
                    users.setdefault(i, []).append(n)
        ready = [n for n in nodes if waiting[id(n)] == 0]
        while ready:
            n = ready.pop(0)
            order.append(n)
            for o in n.output:
                for u in users.get(o, []):
                    waiting[id(u)] -= 1
                    if waiting[id(u)] == 0:
                        ready.append(u)
        if len(order) != len(nodes):
            stuck = [n.name for n in nodes if waiting[id(n)] > 0][:5]
            raise NPUError(f"the graph has a cycle (nodes {stuck} never become ready)")
        for o in self.outputs:
            if o not in produced and o not in known:
                raise NPUError(f"graph output {o!r} is not produced by any node")
        return order

    @functools.cached_property
    def requantizer(self):
        """The requantizer the model's metadata states (``metadata.read_requantizer``), read once."""
        from .metadata import read_requantizer
        return read_requantizer(self.model)

    def attrs(self, n) -> dict:
        key = id(n)
        cached = self._attrs.get(key)
        # The cache holds the node itself: an id() is only unique while its object is alive.
        if cached is None or cached[0] is not n:
            from onnx import helper
            d = {}
            for at in n.attribute:
                v = helper.get_attribute_value(at)
                d[at.name] = v.decode() if isinstance(v, bytes) else v
            cached = self._attrs[key] = (n, d)
        return cached[1]

    def producer(self, name):
        return self._producer.get(name)

    def consumers(self, name):
        return self._consumers.get(name, [])

    def sole_consumer(self, name):
        c = self.consumers(name)
        if len(c) != 1 or name in self.outputs:
            return None
        return c[0]

    def through_identity(self, name):
        """The tensor an ai.onnx Identity chain ending in ``name`` copies (``name`` when no
        Identity produces it). The TorchScript exporter writes one initializer for equal
        tensors (BN-folded biases of zeros) and an Identity per further reader; onnxruntime's
        quantize_static keeps them, so a Conv's bias can be Identity(DequantizeLinear(int32))."""
        p = self._producer.get(name)
        while p is not None and p.op_type == "Identity" and p.domain in ("", "ai.onnx"):
            name = p.input[0]  # the graph is acyclic (toposort), so the chain ends
            p = self._producer.get(name)
        return name

    def const(self, name):
        return self.consts.get(name)

    def const_opt(self, node, i):
        return self.consts.get(node.input[i]) if len(node.input) > i and node.input[i] else None

    def shape_of(self, name):
        if name in self.consts:
            return self.consts[name].shape
        return self._shapes.get(name)

    def clip_bounds(self, n):
        """(lo, hi) of Clip ``n`` from its attributes (opset < 11) or constant inputs (None:
        unbounded); (False, False) when a bound is not a scalar constant or lo > hi; NPUError
        naming the node when a bound is NaN (it would become a platform-defined code)."""
        lo = hi = None
        a = self.attrs(n)
        if self.opset < 11:
            lo, hi = a.get("min"), a.get("max")
        else:
            for i, name in ((1, "lo"), (2, "hi")):
                if len(n.input) > i and n.input[i]:
                    v = self.const(n.input[i])
                    if v is None or v.size != 1:
                        return False, False
                    if i == 1:
                        lo = float(v.reshape(-1)[0])
                    else:
                        hi = float(v.reshape(-1)[0])
        if lo is not None and hi is not None and lo > hi:
            return False, False
        if any(v is not None and np.isnan(v) for v in (lo, hi)):
            raise NPUError(f"node {n.name!r}: Clip bound is NaN (min {lo}, max {hi})")
        return lo, hi
