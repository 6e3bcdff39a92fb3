"""Sampling at computed positions: ``F.grid_sample`` (export/SPEC.md §5b) and deformable
attention's sampling arithmetic (§5g); resizing (``F.interpolate``, ``nn.Upsample``: op class
``resize``; a nearest resize copies codes, the other modes are float ops)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .op import Op

GRID_SAMPLE = Op(
    name="grid_sample",
    op_class="grid_sample",
    handling="functional",
    functions=(F.grid_sample, torch.grid_sampler),
    qat_module="dal.nn.grid_sample:QGridSample",
    onnx=("GridSample",),
    spec="§5b",
    integer_form="dal.convert.grid_sample:float_grid_sample",
    call_form="sampling",
)

RESIZE = Op(
    name="resize",
    op_class="resize",
    handling="float",
    functions=(F.interpolate,),
    modules=(nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d),
    onnx=("Resize",),
    spec="§5a",
    integer_form="dal.convert.float_ops:interpolate_f64",
    cost="vector",
)

OPS: tuple[Op, ...] = (GRID_SAMPLE, RESIZE)
