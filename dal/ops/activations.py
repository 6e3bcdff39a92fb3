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
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="free",
    function="relu",
)

RELU6 = Op(
    name="relu6",
    op_class="activation",
    handling="passthrough",
    functions=(F.relu6,),
    methods=(),
    modules=(nn.ReLU6,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="free",
    function="relu6",
)

HARDTANH = Op(
    name="hardtanh",
    op_class="activation",
    handling="passthrough",
    functions=(F.hardtanh, torch.clamp, torch.clip),
    methods=("clamp", "clamp_", "clip"),
    modules=(nn.Hardtanh,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="free",
)

LEAKY_RELU = Op(
    name="leaky_relu",
    op_class="activation",
    handling="float",
    functions=(F.leaky_relu,),
    methods=(),
    modules=(nn.LeakyReLU,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="leaky_relu",
)

PRELU = Op(
    name="prelu",
    op_class="activation",
    handling="float",
    functions=(),
    methods=(),
    modules=(nn.PReLU,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="prelu",
)

ELU = Op(
    name="elu",
    op_class="activation",
    handling="float",
    functions=(F.elu,),
    methods=(),
    modules=(nn.ELU, nn.CELU),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="elu",
)

SELU = Op(
    name="selu",
    op_class="activation",
    handling="float",
    functions=(),
    methods=(),
    modules=(nn.SELU,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="selu",
)

GELU = Op(
    name="gelu",
    op_class="activation",
    handling="float",
    functions=(F.gelu,),
    methods=(),
    modules=(nn.GELU,),
    qat_module=None,
    onnx=("Gelu",),
    spec="",
    integer_form=None,
    cost="vector",
    function="gelu",
)

SILU = Op(
    name="silu",
    op_class="activation",
    handling="float",
    functions=(F.silu,),
    methods=(),
    modules=(nn.SiLU,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
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
    qat_module=None,
    onnx=("Sigmoid",),
    spec="",
    integer_form=None,
    cost="vector",
    function="sigmoid",
)

TANH = Op(
    name="tanh",
    op_class="activation",
    handling="float",
    functions=(torch.tanh, F.tanh),
    methods=("tanh",),
    modules=(nn.Tanh,),
    qat_module=None,
    onnx=("Tanh",),
    spec="",
    integer_form=None,
    cost="vector",
    function="tanh",
)

HARDSWISH = Op(
    name="hardswish",
    op_class="activation",
    handling="float",
    functions=(F.hardswish,),
    methods=(),
    modules=(nn.Hardswish,),
    qat_module=None,
    onnx=("HardSwish",),
    spec="",
    integer_form=None,
    cost="vector",
    function="hardswish",
)

HARDSIGMOID = Op(
    name="hardsigmoid",
    op_class="activation",
    handling="float",
    functions=(F.hardsigmoid,),
    methods=(),
    modules=(nn.Hardsigmoid,),
    qat_module=None,
    onnx=("HardSigmoid",),
    spec="",
    integer_form=None,
    cost="vector",
    function="hardsigmoid",
)

MISH = Op(
    name="mish",
    op_class="activation",
    handling="float",
    functions=(F.mish,),
    methods=(),
    modules=(nn.Mish,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="mish",
)

SOFTPLUS = Op(
    name="softplus",
    op_class="activation",
    handling="float",
    functions=(F.softplus,),
    methods=(),
    modules=(nn.Softplus,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="softplus",
)

EXP = Op(
    name="exp",
    op_class="activation",
    handling="float",
    functions=(torch.exp,),
    methods=("exp",),
    modules=(),
    qat_module=None,
    onnx=("Exp",),
    spec="",
    integer_form=None,
    cost="vector",
    function="exp",
)

LOG = Op(
    name="log",
    op_class="activation",
    handling="float",
    functions=(),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="log",
)

SQRT = Op(
    name="sqrt",
    op_class="activation",
    handling="float",
    functions=(),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="sqrt",
)

RSQRT = Op(
    name="rsqrt",
    op_class="activation",
    handling="float",
    functions=(),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="rsqrt",
)

RECIPROCAL = Op(
    name="reciprocal",
    op_class="activation",
    handling="float",
    functions=(),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="vector",
    function="reciprocal",
)

OPS: tuple[Op, ...] = (
    RELU, RELU6, HARDTANH, LEAKY_RELU, PRELU, ELU, SELU, GELU, SILU, SIGMOID, TANH, HARDSWISH,
    HARDSIGMOID, MISH, SOFTPLUS, EXP, LOG, SQRT, RSQRT, RECIPROCAL,
)
