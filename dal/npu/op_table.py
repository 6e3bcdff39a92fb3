"""The ONNX node types dal.npu runs: its node-by-node kernel table, with every kernel module loaded.

Each ``ops_*`` module registers its kernels in ``ops_float.OPS`` (op type -> kernel) when it is
imported; a Session runs any node its integer groups do not take with that table's kernel and
refuses a node whose type is not in it (UnsupportedNode, "no implementation for this op type").
So the table's keys are exactly the node types dal.npu runs (default ``""`` / ``ai.onnx`` domain).

    from dal.npu.op_table import op_types
    "GridSample" in op_types()          # True
"""
from __future__ import annotations


def kernels() -> dict:
    """The node-by-node kernel table (ONNX op type -> kernel ``fn(ctx, inputs, attrs) -> outputs``),
    every kernel module imported first. The table is dal.npu's own (a Session reads it); do not
    modify it."""
    from . import ops_cast, ops_einsum, ops_float, ops_nn, ops_quant, ops_reduce, ops_topk, ops_trig  # noqa: F401
    from . import ops_dense  # noqa: F401  (after ops_nn: its Resize adds linear to the nearest kernel)
    from . import ops_grid, ops_scatter  # noqa: F401  (GridSample §5b; Gather*, Scatter* §5c-d: export/SPEC.md)
    from . import ops_activations, ops_depth_to_space  # noqa: F401  (PRelu, Celu, Selu, Sign, LogSoftmax; §5h)
    return ops_float.OPS


def op_types() -> frozenset:
    """Every ONNX op type dal.npu runs (the keys of :func:`kernels`)."""
    return frozenset(kernels())
