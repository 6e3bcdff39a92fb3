"""Softmax and log-softmax (op class ``softmax``): float ops of the vector engine, FP16
islands where it computes in fp16 (dal.prepare.fp16_island)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .op import Op


SOFTMAX = Op(
    name="softmax",
    op_class="softmax",
    handling="float",
    functions=(F.softmax, torch.softmax),
    methods=("softmax",),
    modules=(nn.Softmax,),
    onnx=("Softmax",),
    spec="§5a",
    integer_form="dal.convert.float_ops:softmax_form",  # a form factory (func, opset): dal/convert/op_forms.py
    cost="vector",
)

LOG_SOFTMAX = Op(
    name="log_softmax",
    op_class="softmax",
    handling="float",
    functions=(F.log_softmax,),
    modules=(nn.LogSoftmax,),
    onnx=("LogSoftmax",),
    spec="§5a",
    integer_form="dal.convert.exp_activations:log_softmax_f64",
    cost="vector",
)

OPS: tuple[Op, ...] = (SOFTMAX, LOG_SOFTMAX)
