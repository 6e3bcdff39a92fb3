"""A small editable view of an ONNX graph: constants, producers, consumers, fresh names, cleanup.

The rewrite passes edit ``Graph.nodes`` (plain NodeProto copies) and call ``finish()`` once,
which drops dead nodes and initializers and restores a topological order.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper


class Graph:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.nodes: list[onnx.NodeProto] = []
        for n in g.node:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            self.nodes.append(c)
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.outputs = {o.name for o in g.output}
        self._names = set(self.inits) | {i.name for i in g.input} | {x for n in self.nodes for x in n.output}
        self._node_names = {n.name for n in self.nodes}

    # ---- lookups (recomputed on demand: graphs are small and passes few) -------------------
    def producers(self) -> dict[str, onnx.NodeProto]:
        return {o: n for n in self.nodes for o in n.output}

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        found = defaultdict(list)
        for n in self.nodes:
            for i in n.input:
                if i:
                    found[i].append(n)
        return found

    def const(self, name: str, producers: Optional[dict] = None) -> Optional[np.ndarray]:
        """The value of ``name`` if it is an initializer or a Constant node's tensor, else None."""
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = (producers if producers is not None else self.producers()).get(name)
        if node is not None and node.op_type == "Constant" and not node.input:
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    # ---- additions ---------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A tensor name not used yet, ``base`` itself when free."""
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def add_init(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        self.inits[name] = numpy_helper.from_array(np.asarray(array), name)
        return name

    def make_node(self, op: str, inputs: list[str], outputs: list[str], name: str, **attrs) -> onnx.NodeProto:
        node_name, k = name, 1
        while node_name in self._node_names:
            node_name, k = f"{name}_{k}", k + 1
        self._node_names.add(node_name)
        for o in outputs:
            self._names.add(o)
        return helper.make_node(op, inputs, outputs, name=node_name, **attrs)

    # ---- finish ------------------------------------------------------------------------------
    def finish(self) -> onnx.ModelProto:
        """Write the nodes back: dead code removed, topologically sorted, unused initializers dropped.

        ``value_info`` is cleared: passes change element types (fp16 regions, quantized
        tensors) and stale entries would contradict strict shape inference.
        """
        g = self.model.graph
        live = self._live_nodes()
        ordered = self._toposort(live)
        used = {i for n in ordered for i in n.input} | self.outputs
        del g.node[:]
        g.node.extend(ordered)
        del g.initializer[:]
        g.initializer.extend(t for name, t in self.inits.items() if name in used)
        del g.value_info[:]
        return self.model

    def _live_nodes(self) -> list[onnx.NodeProto]:
        needed = set(self.outputs)
        live = []
        for n in reversed(self.nodes):
            if any(o in needed for o in n.output):
                live.append(n)
                needed.update(i for i in n.input if i)
        return list(reversed(live))

    def _toposort(self, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
        produced = {o: k for k, n in enumerate(nodes) for o in n.output}
        deps = [{produced[i] for i in n.input if i in produced} for n in nodes]
        users = defaultdict(list)
        for k, d in enumerate(deps):
            for j in d:
                users[j].append(k)
        missing = [len(d) for d in deps]
        # Stable Kahn: among ready nodes, keep the original order (readable diffs, same as torch's).
        import heapq

        ready = [k for k, m in enumerate(missing) if m == 0]
        heapq.heapify(ready)
        out = []
        while ready:
            k = heapq.heappop(ready)
            out.append(nodes[k])
            for u in users[k]:
                missing[u] -= 1
                if missing[u] == 0:
                    heapq.heappush(ready, u)
        if len(out) != len(nodes):
            raise RuntimeError("the rewritten graph has a cycle; this is a bug in dal.export")
        return out
