"""Ops of the host op classes (dal.hardware.op_classes.HOST_OP_CLASSES) that no NPU engine
runs unless a hardware model lists their class under ``ops:``: ``nonzero`` (a result whose
shape depends on the values), ``scan`` (running sums and products), ``sort``, ``conv3d`` (3-D
convolutions, transposed too) and ``compare`` (a compare is a host op when an operand is an
integer or bool tensor: a mask built from positions; prepare's float_ops.integer_operand).
``gather`` and ``scatter_add`` are in indexing.py."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .op import Op


NONZERO = Op(
    name="nonzero",
    op_class="nonzero",
    handling="host",
    functions=(torch.nonzero,),
    methods=("nonzero",),
)

ARGWHERE = Op(
    name="argwhere",
    op_class="nonzero",
    handling="host",
    functions=(torch.argwhere,),
    methods=("argwhere",),
)

MASKED_SELECT = Op(
    name="masked_select",
    op_class="nonzero",
    handling="host",
    functions=(torch.masked_select,),
    methods=("masked_select",),
)

UNIQUE = Op(
    name="unique",
    op_class="nonzero",
    handling="host",
    functions=(torch.unique,),
    methods=("unique",),
)

CUMSUM = Op(
    name="cumsum",
    op_class="scan",
    handling="host",
    functions=(torch.cumsum,),
    methods=("cumsum",),
    integer_form="dal.convert.float_ops:cumsum_f64",
)

CUMPROD = Op(
    name="cumprod",
    op_class="scan",
    handling="host",
    functions=(torch.cumprod,),
    methods=("cumprod",),
)

CUMMAX = Op(
    name="cummax",
    op_class="scan",
    handling="host",
    functions=(torch.cummax,),
)

CUMMIN = Op(
    name="cummin",
    op_class="scan",
    handling="host",
    functions=(torch.cummin,),
)

SORT = Op(
    name="sort",
    op_class="sort",
    handling="host",
    functions=(torch.sort,),
    methods=("sort",),
)

ARGSORT = Op(
    name="argsort",
    op_class="sort",
    handling="host",
    functions=(torch.argsort,),
    methods=("argsort",),
)

TOPK = Op(
    name="topk",
    op_class="sort",
    handling="host",
    functions=(torch.topk,),
    methods=("topk",),
    integer_form="dal.convert.float_ops:topk_onnx",
)

CONV3D = Op(
    name="conv3d",
    op_class="conv3d",
    handling="host",
    functions=(F.conv3d,),
    modules=(nn.Conv3d, nn.ConvTranspose3d),
)

LT = Op(
    name="lt",
    op_class="compare",
    handling="host",
    functions=(operator.lt, torch.lt, torch.less),
    methods=("lt", "__lt__"),
)

LE = Op(
    name="le",
    op_class="compare",
    handling="host",
    functions=(operator.le, torch.le, torch.less_equal),
    methods=("le", "__le__"),
)

GT = Op(
    name="gt",
    op_class="compare",
    handling="host",
    functions=(operator.gt, torch.gt, torch.greater),
    methods=("gt", "__gt__"),
)

GE = Op(
    name="ge",
    op_class="compare",
    handling="host",
    functions=(operator.ge, torch.ge, torch.greater_equal),
    methods=("ge", "__ge__"),
)

EQ = Op(
    name="eq",
    op_class="compare",
    handling="host",
    functions=(operator.eq, torch.eq),
    methods=("eq", "__eq__"),
)

NE = Op(
    name="ne",
    op_class="compare",
    handling="host",
    functions=(operator.ne, torch.ne, torch.not_equal),
    methods=("ne", "__ne__"),
)

OPS: tuple[Op, ...] = (
    NONZERO, ARGWHERE, MASKED_SELECT, UNIQUE, CUMSUM, CUMPROD, CUMMAX, CUMMIN, SORT, ARGSORT, TOPK,
    CONV3D, LT, LE, GT, GE, EQ, NE,
)
