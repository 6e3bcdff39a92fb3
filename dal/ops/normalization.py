"""Normalisations: float ops of the vector engine unless folded into the conv before them.

``op_class`` is a hardware op class where hardware models name one (``layernorm``); the
others are ``custom`` (no hardware model lists batch, group or instance norm: prepare calls
them ``norm``). ``qat_module``: dal.nn's form of the layer where it has one (QBatchNorm2d, a
quantized per-channel affine; the FP16 group / instance norms). ``rmsnorm`` is found by what
a module computes (dal.prepare.whole_modules), so it matches no pattern."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .op import Op


BATCHNORM2D = Op(
    name="batchnorm2d",
    op_class="custom",
    handling="float",
    modules=(nn.BatchNorm2d,),
    qat_module="dal.nn.norm:QBatchNorm2d",
    onnx=("Conv", "BatchNormalization"),
    spec="§5a",
    function="batchnorm",
)

BATCHNORM = Op(
    name="batchnorm",
    op_class="custom",
    handling="float",
    functions=(F.batch_norm,),
    modules=(nn.BatchNorm1d, nn.BatchNorm3d),
    onnx=("BatchNormalization",),
    spec="§5a",
    integer_form="dal.convert.float_ops:batch_norm_f64",
)

LAYERNORM = Op(
    name="layernorm",
    op_class="layernorm",
    handling="float",
    functions=(F.layer_norm,),
    modules=(nn.LayerNorm,),
    onnx=("LayerNormalization", "ReduceMean", "Sub", "Pow", "Add", "Sqrt", "Div", "Mul"),
    spec="§5a",
    integer_form="dal.convert.float_ops:layer_norm_form",  # a form factory (func, opset): dal/convert/op_forms.py
    cost="vector",
)

GROUPNORM = Op(
    name="groupnorm",
    op_class="custom",
    handling="float",
    functions=(F.group_norm,),
    modules=(nn.GroupNorm,),
    qat_module="dal.nn.norm:Fp16GroupNorm",
    onnx=("Reshape", "InstanceNormalization", "Shape", "Mul", "Add"),
    spec="§5a",
    integer_form="dal.convert.instancenorm:group_norm_onnx",
)

INSTANCENORM2D = Op(
    name="instancenorm2d",
    op_class="custom",
    handling="float",
    modules=(nn.InstanceNorm2d,),
    qat_module="dal.nn.norm:Fp16InstanceNorm2d",
    onnx=("InstanceNormalization",),
    spec="§5a",
    function="instancenorm",
)

INSTANCENORM = Op(
    name="instancenorm",
    op_class="custom",
    handling="float",
    functions=(F.instance_norm,),
    modules=(nn.InstanceNorm1d,),
    onnx=("InstanceNormalization",),
    spec="§5a",
    integer_form="dal.convert.float_ops:instance_norm_form",
)

RMSNORM = Op(
    name="rmsnorm",
    op_class="custom",
    handling="float",
    onnx=("Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"),
    spec="§5a",
)

OPS: tuple[Op, ...] = (BATCHNORM2D, BATCHNORM, LAYERNORM, GROUPNORM, INSTANCENORM2D, INSTANCENORM, RMSNORM)
