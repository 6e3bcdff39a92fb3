"""What the cost model charges, read from the op registry (:mod:`dal.ops`, each op's ``cost``).

An op's ``cost`` is ``"matrix"`` (MACs on the matrix engine), ``"vector"`` (element-wise passes)
or ``"free"`` (folded into its producer's requantizer, or exact on codes); None: not charged.

- :func:`matrix_classes` / :func:`vector_classes`: the op classes of the ops charged as matrix /
  vector layers;
- :func:`free_activations`: the functions (``op.function``, else ``op.name``) of the activation
  ops that cost nothing (a clip of the producer's output range);
- :func:`module_cost`: the cost class of a module's own op (a registered float type, the user's
  ``@dal.ops.register`` types included), or None when its op does not say;
- :func:`onnx_node_ops`: ONNX node type -> the op it belongs to. A node type belongs to the
  first op, in registry order, whose whole export pattern it is (``onnx == (type,)``: ``MatMul``
  is matmul's, though linear's pattern lists it too); a node type of several ops' patterns and
  of none alone belongs to them when they all have the same ``cost`` and ``op_class`` (``Gemm``:
  linear), else to none (``Div``: layer norm's and a reshape's): it is not timed. ``embedding``'s
  ``Gather`` is left out: a ``Gather`` is also shape arithmetic and indexing, so the graph
  reader finds embeddings by their pattern (a 2-D table, :mod:`dal.cost.onnx_patterns`).

Tables are derived on first use and again after the registry changes (:func:`dal.ops.version`).
"""
from __future__ import annotations

from functools import cache
from typing import Optional

from torch import nn

from .. import ops


@cache
def _classes(version: int, cost: str) -> frozenset:
    return frozenset(op.op_class for op in ops.all_ops() if op.cost == cost)


def matrix_classes() -> frozenset:
    """Op classes of the ops whose ``cost`` is ``"matrix"`` (conv, linear, matmul, ...)."""
    return _classes(ops.version(), "matrix")


def vector_classes() -> frozenset:
    """Op classes of the ops whose ``cost`` is ``"vector"`` (add, pool, activation, ...)."""
    return _classes(ops.version(), "vector")


@cache
def _free_activations(version: int) -> frozenset:
    return frozenset(op.function or op.name for op in ops.select(op_class="activation", cost="free"))


def free_activations() -> frozenset:
    """Functions of the ``activation`` ops whose ``cost`` is ``"free"`` (relu, relu6, hardtanh)."""
    return _free_activations(ops.version())


def module_cost(mod: nn.Module, float_type: Optional[type] = None) -> Optional[tuple[str, str]]:
    """``(cost, op_class)`` of the op matching ``float_type`` (default ``type(mod)``) exactly, or
    None when no op matches it or its op's ``cost`` is None."""
    op = ops.by_module(float_type or type(mod))
    if op is None or op.cost is None:
        return None
    return op.cost, op.op_class


@cache
def _onnx_node_ops(version: int) -> dict:
    owner: dict = {}
    candidates = [op for op in ops.all_ops() if op.name != "embedding"]
    for op in candidates:
        if len(op.onnx) == 1:
            owner.setdefault(op.onnx[0], op)
    listed: dict = {}
    for op in candidates:
        for node_type in op.onnx:
            if node_type not in owner:
                listed.setdefault(node_type, []).append(op)
    for node_type, claimants in listed.items():
        if len({(op.cost, op.op_class) for op in claimants}) == 1:
            owner[node_type] = claimants[0]
    return owner


def onnx_node_ops() -> dict:
    """ONNX node type -> the :class:`~dal.ops.Op` it belongs to (see the module docstring)."""
    return _onnx_node_ops(ops.version())


def onnx_classes(cost: str) -> dict:
    """ONNX node type -> op class, for the node types whose op's ``cost`` is ``cost``."""
    return {t: op.op_class for t, op in onnx_node_ops().items() if op.cost == cost}


def onnx_passthrough() -> frozenset:
    """ONNX node types of vector ops exact on codes (``handling="passthrough"``: max pooling),
    which run in the format of the layer before them."""
    return frozenset(t for t, op in onnx_node_ops().items() if op.cost == "vector" and op.handling == "passthrough")
