"""Attention's products: batched matrix products of two activations (``Q @ K^T``, ``P @ V``) on the
matrix engine, with int32 accumulation and the requantizer."""
from __future__ import annotations

import operator

import torch

from .op import Op

MATMUL = Op(
    name="matmul",
    op_class="matmul",
    handling="functional",
    functions=(operator.matmul, torch.matmul, torch.bmm),
    methods=("matmul", "__matmul__", "bmm"),
    qat_module="dal.nn.functional:QMatMul",
    onnx=("MatMul",),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

OPS: tuple[Op, ...] = (MATMUL,)
