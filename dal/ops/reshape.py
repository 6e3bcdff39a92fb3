"""Concatenation and the reshape-likes: ops that move codes without changing them.

The reshape-likes (views, slices, stacking, padding with zeros, dropout and identity in eval,
casts between float dtypes) are exact on integer codes (``handling="passthrough"``); no hardware
op class names them (``op_class="custom"``)."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

from .op import Op

CAT = Op(
    name="cat",
    op_class="cat",
    handling="functional",
    functions=(torch.cat, torch.concat, torch.concatenate),
    methods=(),
    qat_module="dal.nn.functional:QCat",
    onnx=("Concat",),
    spec="§5a",
    integer_form=None,
    cost="vector",
    fp16_region=("compute",),
    call_form="sequence",
)

FLATTEN = Op(
    name="flatten",
    op_class="custom",
    handling="passthrough",
    functions=(torch.flatten,),
    methods=("flatten",),
    modules=(nn.Flatten,),
    qat_module=None,
    onnx=("Flatten",),
    spec="§5h",
    integer_form=None,
    cost="free",
)

UNFLATTEN = Op(
    name="unflatten",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=(),
    modules=(nn.Unflatten,),
    qat_module=None,
    onnx=("Reshape", "Shape", "Slice", "Concat", "Add", "Mod"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

RESHAPE = Op(
    name="reshape",
    op_class="custom",
    handling="passthrough",
    functions=(torch.reshape,),
    methods=("reshape", "view", "view_as", "reshape_as"),
    modules=(),
    qat_module=None,
    onnx=("Reshape",),
    spec="§5h",
    integer_form=None,
    cost="free",
)

PERMUTE = Op(
    name="permute",
    op_class="custom",
    handling="passthrough",
    functions=(torch.permute,),
    methods=("permute", "movedim"),
    modules=(),
    qat_module=None,
    onnx=("Transpose",),
    spec="§5h",
    integer_form=None,
    cost="free",
)

TRANSPOSE = Op(
    name="transpose",
    op_class="custom",
    handling="passthrough",
    functions=(torch.transpose, torch.t),
    methods=("transpose", "t"),
    modules=(),
    qat_module=None,
    onnx=("Transpose",),
    spec="§5h",
    integer_form=None,
    cost="free",
)

SQUEEZE = Op(
    name="squeeze",
    op_class="custom",
    handling="passthrough",
    functions=(torch.squeeze, torch.unsqueeze),
    methods=("squeeze", "unsqueeze"),
    modules=(),
    qat_module=None,
    onnx=("Squeeze", "Unsqueeze"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

SPLIT = Op(
    name="split",
    op_class="custom",
    handling="passthrough",
    functions=(torch.chunk, torch.split),
    methods=("chunk", "split", "unbind"),
    modules=(),
    qat_module=None,
    onnx=("Split", "Slice", "Squeeze", "Shape", "Gather", "Add", "Div", "Mul"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

SLICE = Op(
    name="slice",
    op_class="custom",
    handling="passthrough",
    functions=(operator.getitem, torch.narrow),
    methods=("__getitem__", "narrow"),
    modules=(),
    qat_module=None,
    onnx=("Slice", "Gather"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

EXPAND = Op(
    name="expand",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=("expand", "expand_as", "repeat"),
    modules=(),
    qat_module=None,
    onnx=("Expand", "Tile"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

FLIP = Op(
    name="flip",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=("flip",),
    modules=(),
    qat_module=None,
    onnx=("Slice",),
    spec="§5h",
    integer_form=None,
    cost="free",
)

STACK = Op(
    name="stack",
    op_class="custom",
    handling="passthrough",
    functions=(torch.stack,),
    methods=(),
    modules=(),
    qat_module=None,
    onnx=("Unsqueeze", "Concat"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

PAD = Op(
    name="pad",
    op_class="custom",
    handling="passthrough",
    functions=(F.pad,),
    methods=(),
    modules=(nn.ZeroPad2d,),
    qat_module=None,
    onnx=("Pad", "Concat", "Reshape", "Slice", "Transpose", "Cast"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

CHANNEL_SHUFFLE = Op(
    name="channel_shuffle",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=(),
    modules=(nn.ChannelShuffle,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="free",
)

PIXEL_SHUFFLE = Op(
    name="pixel_shuffle",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=(),
    modules=(nn.PixelShuffle, nn.PixelUnshuffle),
    qat_module=None,
    onnx=("DepthToSpace", "Reshape", "Transpose"),
    spec="§5h",
    integer_form=None,
    cost="free",
)

IDENTITY = Op(
    name="identity",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=("contiguous", "detach", "clone"),
    modules=(nn.Identity,),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="free",
)

DROPOUT = Op(
    name="dropout",
    op_class="custom",
    handling="passthrough",
    functions=(F.dropout,),
    methods=(),
    modules=(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout),
    qat_module=None,
    onnx=(),
    spec="",
    integer_form=None,
    cost="free",
)

CAST = Op(
    name="cast",
    op_class="custom",
    handling="passthrough",
    functions=(),
    methods=("to", "float", "type_as"),
    modules=(),
    qat_module=None,
    onnx=("Cast",),
    spec="§5h",
    integer_form=None,
    cost="free",
)

OPS: tuple[Op, ...] = (
    CAT, FLATTEN, UNFLATTEN, RESHAPE, PERMUTE, TRANSPOSE, SQUEEZE, SPLIT, SLICE, EXPAND, FLIP, STACK,
    PAD, CHANNEL_SHUFFLE, PIXEL_SHUFFLE, IDENTITY, DROPOUT, CAST,
)
