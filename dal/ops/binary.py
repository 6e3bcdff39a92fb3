"""Element-wise binary ops on two tensors: the NPU's requantizing adder and multiplier."""
from __future__ import annotations

import operator

import torch

from .op import Op

ADD = Op(
    name="add",
    op_class="add",
    handling="functional",
    functions=(operator.add, operator.iadd, torch.add),
    methods=("add", "add_", "__add__", "__radd__", "__iadd__"),
    qat_module="dal.nn.functional:QAdd",
    onnx=("Add",),
    spec="§5a",
    cost="vector",
    fp16_region=("compute", "tail"),
    neutral=(0, True),
)

MUL = Op(
    name="mul",
    op_class="mul",
    handling="functional",
    functions=(operator.mul, operator.imul, torch.mul),
    methods=("mul", "mul_", "__mul__", "__rmul__", "__imul__"),
    qat_module="dal.nn.functional:QMul",
    onnx=("Mul",),
    spec="§5a",
    cost="vector",
    fp16_region=("compute", "tail"),
    neutral=(1, True),
)

#: a float subtraction of two tensors (prepare classifies its calls by name, as float
#: element-wise arithmetic: dal/prepare/site_kinds.py); declared for its export pattern
SUB = Op(
    name="sub",
    op_class="custom",
    handling="float",
    onnx=("Sub",),
    spec="§5a",
    fp16_region=("compute", "tail"),
    neutral=(0, False),
)

OPS: tuple[Op, ...] = (ADD, MUL, SUB)
