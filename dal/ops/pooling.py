"""Pooling (op class ``pool``): max pooling selects a code (exact on codes: passthrough);
average pooling and ``mean`` average on the vector engine (``function="average"``). Power-average
pooling (LPPool) is a type recipes name that dal has no form for (``qat_module`` None)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .op import Op


MAX_POOL = Op(
    name="max_pool",
    op_class="pool",
    handling="passthrough",
    functions=(F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool2d),
    modules=(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
    onnx=("MaxPool", "GlobalMaxPool"),
    spec="§5a",
    cost="vector",
)

AVG_POOL = Op(
    name="avg_pool",
    op_class="pool",
    handling="float",
    functions=(F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_avg_pool1d),
    modules=(nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
    onnx=("AveragePool", "GlobalAveragePool"),
    spec="§5a",
    integer_form="dal.convert.float_ops:average_pool_form",  # a form factory (func, opset): dal/convert/op_forms.py
    cost="vector",
    function="average",
)

MEAN = Op(
    name="mean",
    op_class="pool",
    handling="float",
    functions=(torch.mean,),
    methods=("mean",),
    onnx=("ReduceMean",),
    spec="§5a",
    integer_form="dal.convert.float_ops:reduce_mean_f64",
    cost="vector",
    function="average",
)

LP_POOL = Op(
    name="lp_pool",
    op_class="pool",
    handling="quantize",
    modules=(nn.LPPool1d, nn.LPPool2d, nn.LPPool3d),
    onnx=("Pow", "AveragePool", "Sign", "Abs", "Relu", "Mul"),
    spec="§5a",
    cost="vector",
)

OPS: tuple[Op, ...] = (MAX_POOL, AVG_POOL, MEAN, LP_POOL)
