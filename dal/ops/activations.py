"""Element-wise activations (op class ``activation``).

The relu-likes (relu, relu6, hardtanh: a clamp of the code range, ``torch.clamp`` included) are
exact on integer codes: ``handling="passthrough"``. The others are float ops of the vector
engine: an FP16 island where the hardware model lists them in ``fp16_ops``, a lookup table
where it lists them in ``lut_ops``. ``function`` is set on exactly the ops a hardware model may
name in ``fp16_ops`` / ``lut_ops`` (dal.hardware.op_classes.ACTIVATION_FUNCTIONS); log, sqrt,
rsqrt and reciprocal are such names that no float pattern of prepare matches."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .op import Op


RELU = Op(
    name="relu",
    op_class="activation",
    handling="passthrough",
    functions=(F.relu, torch.relu, torch.relu_),
    methods=("relu", "relu_"),
    modules=(nn.ReLU,),
    onnx=("Relu",),
    spec="§5a",
    cost="free",
    function="relu",
    fp16_region=("tail",),
)

RELU6 = Op(
    name="relu6",
    op_class="activation",
    handling="passthrough",
    functions=(F.relu6,),
    modules=(nn.ReLU6,),
    onnx=("Clip",),
    spec="§5a",
    cost="free",
    function="relu6",
    fp16_region=("tail",),
)

HARDTANH = Op(
    name="hardtanh",
    op_class="activation",
    handling="passthrough",
    functions=(F.hardtanh, torch.clamp, torch.clip),
    methods=("clamp", "clamp_", "clip"),
    modules=(nn.Hardtanh,),
    onnx=("Clip",),
    spec="§5a",
    cost="free",
    fp16_region=("tail",),
)

LEAKY_RELU = Op(
    name="leaky_relu",
    op_class="activation",
    handling="float",
    functions=(F.leaky_relu,),
    modules=(nn.LeakyReLU,),
    onnx=("LeakyRelu",),
    spec="§5a",
    cost="vector",
    function="leaky_relu",
    fp16_region=("tail",),
)

PRELU = Op(
    name="prelu",
    op_class="activation",
    handling="float",
    modules=(nn.PReLU,),
    onnx=("PRelu",),
    spec="§5a",
    cost="vector",
    function="prelu",
)

ELU = Op(
    name="elu",
    op_class="activation",
    handling="float",
    functions=(F.elu, F.celu),
    modules=(nn.ELU, nn.CELU),
    onnx=("Elu", "Celu"),
    spec="§5a",
    integer_form="dal.convert.exp_activations:elu_form",  # a form factory (func, opset): dal/convert/op_forms.py
    cost="vector",
    function="elu",
)

SELU = Op(
    name="selu",
    op_class="activation",
    handling="float",
    functions=(F.selu,),
    modules=(nn.SELU,),
    onnx=("Selu",),
    spec="§5a",
    integer_form="dal.convert.exp_activations:selu_f64",
    cost="vector",
    function="selu",
)

GELU = Op(
    name="gelu",
    op_class="activation",
    handling="float",
    functions=(F.gelu,),
    modules=(nn.GELU,),
    onnx=("Div", "Erf", "Add", "Mul", "Tanh", "Gelu"),
    spec="§5a",
    integer_form="dal.convert.float_ops:gelu_form",  # a form factory (func, opset): dal/convert/op_forms.py
    cost="vector",
    function="gelu",
)

SILU = Op(
    name="silu",
    op_class="activation",
    handling="float",
    functions=(F.silu,),
    modules=(nn.SiLU,),
    onnx=("Sigmoid", "Mul"),
    spec="§5a",
    integer_form="dal.convert.float_ops:silu_f64",
    cost="vector",
    function="silu",
)

SIGMOID = Op(
    name="sigmoid",
    op_class="activation",
    handling="float",
    functions=(torch.sigmoid, F.sigmoid),
    methods=("sigmoid",),
    modules=(nn.Sigmoid,),
    onnx=("Sigmoid",),
    spec="§5a",
    integer_form="dal.convert.float_ops:sigmoid_f64",
    cost="vector",
    function="sigmoid",
    fp16_region=("tail",),
)

TANH = Op(
    name="tanh",
    op_class="activation",
    handling="float",
    functions=(torch.tanh, F.tanh),
    methods=("tanh",),
    modules=(nn.Tanh,),
    onnx=("Tanh",),
    spec="§5a",
    integer_form="dal.convert.float_ops:tanh_f64",
    cost="vector",
    function="tanh",
    fp16_region=("tail",),
)

HARDSWISH = Op(
    name="hardswish",
    op_class="activation",
    handling="float",
    functions=(F.hardswish,),
    modules=(nn.Hardswish,),
    onnx=("HardSigmoid", "Mul", "HardSwish"),
    spec="§5a",
    integer_form="dal.convert.float_ops:hardswish_f32",
    cost="vector",
    function="hardswish",
)

HARDSIGMOID = Op(
    name="hardsigmoid",
    op_class="activation",
    handling="float",
    functions=(F.hardsigmoid,),
    modules=(nn.Hardsigmoid,),
    onnx=("HardSigmoid",),
    spec="§5a",
    integer_form="dal.convert.float_ops:hardsigmoid_f32",
    cost="vector",
    function="hardsigmoid",
)

MISH = Op(
    name="mish",
    op_class="activation",
    handling="float",
    functions=(F.mish,),
    modules=(nn.Mish,),
    onnx=("Softplus", "Tanh", "Mul"),
    spec="§5a",
    integer_form="dal.convert.exp_activations:mish_f64",
    cost="vector",
    function="mish",
)

SOFTPLUS = Op(
    name="softplus",
    op_class="activation",
    handling="float",
    functions=(F.softplus,),
    modules=(nn.Softplus,),
    onnx=("Softplus",),
    spec="§5a",
    integer_form="dal.convert.exp_activations:softplus_f64",
    cost="vector",
    function="softplus",
)

EXP = Op(
    name="exp",
    op_class="activation",
    handling="float",
    functions=(torch.exp,),
    methods=("exp",),
    onnx=("Exp",),
    spec="§5a",
    cost="vector",
    function="exp",
)

LOG = Op(
    name="log",
    op_class="activation",
    handling="float",
    onnx=("Log",),
    spec="§5a",
    cost="vector",
    function="log",
)

SQRT = Op(
    name="sqrt",
    op_class="activation",
    handling="float",
    onnx=("Sqrt",),
    spec="§5a",
    cost="vector",
    function="sqrt",
)

RSQRT = Op(
    name="rsqrt",
    op_class="activation",
    handling="float",
    onnx=("Sqrt", "Div"),
    spec="§5a",
    cost="vector",
    function="rsqrt",
)

RECIPROCAL = Op(
    name="reciprocal",
    op_class="activation",
    handling="float",
    onnx=("Reciprocal",),
    spec="§5a",
    cost="vector",
    function="reciprocal",
)

OPS: tuple[Op, ...] = (
    RELU, RELU6, HARDTANH, LEAKY_RELU, PRELU, ELU, SELU, GELU, SILU, SIGMOID, TANH, HARDSWISH,
    HARDSIGMOID, MISH, SOFTPLUS, EXP, LOG, SQRT, RSQRT, RECIPROCAL,
)
