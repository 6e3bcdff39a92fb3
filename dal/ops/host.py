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
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

ARGWHERE = Op(
    name="argwhere",
    op_class="nonzero",
    handling="host",
    functions=(torch.argwhere,),
    methods=("argwhere",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

MASKED_SELECT = Op(
    name="masked_select",
    op_class="nonzero",
    handling="host",
    functions=(torch.masked_select,),
    methods=("masked_select",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

UNIQUE = Op(
    name="unique",
    op_class="nonzero",
    handling="host",
    functions=(torch.unique,),
    methods=("unique",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

CUMSUM = Op(
    name="cumsum",
    op_class="scan",
    handling="host",
    functions=(torch.cumsum,),
    methods=("cumsum",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form="dal.convert.float_ops:cumsum_f64",
    cost=None,
)

CUMPROD = Op(
    name="cumprod",
    op_class="scan",
    handling="host",
    functions=(torch.cumprod,),
    methods=("cumprod",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

CUMMAX = Op(
    name="cummax",
    op_class="scan",
    handling="host",
    functions=(torch.cummax,),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

CUMMIN = Op(
    name="cummin",
    op_class="scan",
    handling="host",
    functions=(torch.cummin,),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

SORT = Op(
    name="sort",
    op_class="sort",
    handling="host",
    functions=(torch.sort,),
    methods=("sort",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

ARGSORT = Op(
    name="argsort",
    op_class="sort",
    handling="host",
    functions=(torch.argsort,),
    methods=("argsort",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

TOPK = Op(
    name="topk",
    op_class="sort",
    handling="host",
    functions=(torch.topk,),
    methods=("topk",),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form="dal.convert.float_ops:topk_onnx",
    cost=None,
)

CONV3D = Op(
    name="conv3d",
    op_class="conv3d",
    handling="host",
    functions=(F.conv3d,),
    methods=(),
    modules=(nn.Conv3d, nn.ConvTranspose3d),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

LT = Op(
    name="lt",
    op_class="compare",
    handling="host",
    functions=(operator.lt, torch.lt, torch.less),
    methods=("lt", "__lt__"),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

LE = Op(
    name="le",
    op_class="compare",
    handling="host",
    functions=(operator.le, torch.le, torch.less_equal),
    methods=("le", "__le__"),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

GT = Op(
    name="gt",
    op_class="compare",
    handling="host",
    functions=(operator.gt, torch.gt, torch.greater),
    methods=("gt", "__gt__"),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

GE = Op(
    name="ge",
    op_class="compare",
    handling="host",
    functions=(operator.ge, torch.ge, torch.greater_equal),
    methods=("ge", "__ge__"),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

EQ = Op(
    name="eq",
    op_class="compare",
    handling="host",
    functions=(operator.eq, torch.eq),
    methods=("eq", "__eq__"),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

NE = Op(
    name="ne",
    op_class="compare",
    handling="host",
    functions=(operator.ne, torch.ne, torch.not_equal),
    methods=("ne", "__ne__"),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost=None,
)

OPS: tuple[Op, ...] = (
    NONZERO, ARGWHERE, MASKED_SELECT, UNIQUE, CUMSUM, CUMPROD, CUMMAX, CUMMIN, SORT, ARGSORT, TOPK,
    CONV3D, LT, LE, GT, GE, EQ, NE,
)
