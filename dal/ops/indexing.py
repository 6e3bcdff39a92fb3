"""Indexed reads and writes on codes: gather (export/SPEC.md §5d) and scatter-add, BEV pooling's
accumulation in int32 (§5c)."""
from __future__ import annotations

import torch

from .op import Op

GATHER = Op(
    name="gather",
    op_class="gather",
    handling="functional",
    functions=(torch.gather, torch.index_select, torch.take_along_dim),
    methods=("gather", "index_select", "take_along_dim"),
    qat_module="dal.nn.gather:QGather",
    onnx=("GatherElements", "Gather"),
    spec="§5d",
    call_form="index",
)

SCATTER_ADD = Op(
    name="scatter_add",
    op_class="scatter_add",
    handling="functional",
    functions=(torch.scatter_add, torch.index_add, torch.index_put, torch.index_put_),
    methods=("scatter_add", "scatter_add_", "index_add", "index_add_", "index_put", "index_put_"),
    qat_module="dal.nn.scatter_add:QScatterAdd",
    onnx=("ScatterElements", "ScatterND"),
    spec="§5c",
    call_form="index",
)

OPS: tuple[Op, ...] = (GATHER, SCATTER_ADD)
