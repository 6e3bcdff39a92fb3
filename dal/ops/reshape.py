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
    qat_module="dal.nn.functional:QCat",
    onnx=("Concat",),
    spec="§5a",
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
    onnx=("Flatten",),
    spec="§5h",
    cost="free",
)

UNFLATTEN = Op(
    name="unflatten",
    op_class="custom",
    handling="passthrough",
    modules=(nn.Unflatten,),
    onnx=("Reshape", "Shape", "Slice", "Concat", "Add", "Mod"),
    spec="§5h",
    cost="free",
)

RESHAPE = Op(
    name="reshape",
    op_class="custom",
    handling="passthrough",
    functions=(torch.reshape,),
    methods=("reshape", "view", "view_as", "reshape_as"),
    onnx=("Reshape",),
    spec="§5h",
    cost="free",
)

PERMUTE = Op(
    name="permute",
    op_class="custom",
    handling="passthrough",
    functions=(torch.permute,),
    methods=("permute", "movedim"),
    onnx=("Transpose",),
    spec="§5h",
    cost="free",
)

TRANSPOSE = Op(
    name="transpose",
    op_class="custom",
    handling="passthrough",
    functions=(torch.transpose, torch.t),
    methods=("transpose", "t"),
    onnx=("Transpose",),
    spec="§5h",
    cost="free",
)

SQUEEZE = Op(
    name="squeeze",
    op_class="custom",
    handling="passthrough",
    functions=(torch.squeeze, torch.unsqueeze),
    methods=("squeeze", "unsqueeze"),
    onnx=("Squeeze", "Unsqueeze"),
    spec="§5h",
    cost="free",
)

SPLIT = Op(
    name="split",
    op_class="custom",
    handling="passthrough",
    functions=(torch.chunk, torch.split),
    methods=("chunk", "split", "unbind"),
    onnx=("Split", "Slice", "Squeeze", "Shape", "Gather", "Add", "Div", "Mul"),
    spec="§5h",
    cost="free",
)

SLICE = Op(
    name="slice",
    op_class="custom",
    handling="passthrough",
    functions=(operator.getitem, torch.narrow),
    methods=("__getitem__", "narrow"),
    onnx=("Slice", "Gather"),
    spec="§5h",
    cost="free",
)

EXPAND = Op(
    name="expand",
    op_class="custom",
    handling="passthrough",
    methods=("expand", "expand_as", "repeat"),
    onnx=("Expand", "Tile"),
    spec="§5h",
    cost="free",
)

FLIP = Op(
    name="flip",
    op_class="custom",
    handling="passthrough",
    methods=("flip",),
    onnx=("Slice",),
    spec="§5h",
    cost="free",
)

STACK = Op(
    name="stack",
    op_class="custom",
    handling="passthrough",
    functions=(torch.stack,),
    onnx=("Unsqueeze", "Concat"),
    spec="§5h",
    cost="free",
)

PAD = Op(
    name="pad",
    op_class="custom",
    handling="passthrough",
    functions=(F.pad,),
    modules=(nn.ZeroPad2d,),
    onnx=("Pad", "Concat", "Reshape", "Slice", "Transpose", "Cast"),
    spec="§5h",
    cost="free",
)

CHANNEL_SHUFFLE = Op(
    name="channel_shuffle",
    op_class="custom",
    handling="passthrough",
    modules=(nn.ChannelShuffle,),
    cost="free",
)

PIXEL_SHUFFLE = Op(
    name="pixel_shuffle",
    op_class="custom",
    handling="passthrough",
    modules=(nn.PixelShuffle, nn.PixelUnshuffle),
    onnx=("DepthToSpace", "Reshape", "Transpose"),
    spec="§5h",
    cost="free",
)

IDENTITY = Op(
    name="identity",
    op_class="custom",
    handling="passthrough",
    methods=("contiguous", "detach", "clone"),
    modules=(nn.Identity,),
    cost="free",
)

DROPOUT = Op(
    name="dropout",
    op_class="custom",
    handling="passthrough",
    functions=(F.dropout,),
    modules=(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout),
    cost="free",
)

CAST = Op(
    name="cast",
    op_class="custom",
    handling="passthrough",
    methods=("to", "float", "type_as"),
    onnx=("Cast",),
    spec="§5h",
    cost="free",
)

OPS: tuple[Op, ...] = (
    CAT, FLATTEN, UNFLATTEN, RESHAPE, PERMUTE, TRANSPOSE, SQUEEZE, SPLIT, SLICE, EXPAND, FLIP, STACK,
    PAD, CHANNEL_SHUFFLE, PIXEL_SHUFFLE, IDENTITY, DROPOUT, CAST,
)
