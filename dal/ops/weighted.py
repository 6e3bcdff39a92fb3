"""Layers with weights, on the matrix engine: convolutions, linear layers, embeddings.

``handling="quantize"``: prepare replaces the module by its QAT module. An op whose
``qat_module`` is None is a layer type recipes name (``type: LazyLinear``) that dal has no QAT
module for: prepare reports it as a layer with parameters and no QAT class. The 3-D
convolutions are host ops (host.py). transformers' ``Conv1D`` and peft's LoRA ``Linear`` are
registered by dal.nn when prepare meets them (``dal.nn.registry.LAZY_QAT_MODULES``): naming
their types here would import those libraries."""
from __future__ import annotations

from torch import nn

from .op import Op


CONV1D = Op(
    name="conv1d",
    op_class="conv",
    handling="quantize",
    modules=(nn.Conv1d,),
    qat_module="dal.nn.conv:QConv1d",
    onnx=("Conv",),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

CONV2D = Op(
    name="conv2d",
    op_class="conv",
    handling="quantize",
    modules=(nn.Conv2d,),
    qat_module="dal.nn.conv:QConv2d",
    onnx=("Conv",),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

CONV_TRANSPOSE1D = Op(
    name="conv_transpose1d",
    op_class="conv_transpose",
    handling="quantize",
    modules=(nn.ConvTranspose1d,),
    onnx=("ConvTranspose",),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

CONV_TRANSPOSE2D = Op(
    name="conv_transpose2d",
    op_class="conv_transpose",
    handling="quantize",
    modules=(nn.ConvTranspose2d,),
    qat_module="dal.nn.conv:QConvTranspose2d",
    onnx=("ConvTranspose",),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

LINEAR = Op(
    name="linear",
    op_class="linear",
    handling="quantize",
    modules=(nn.Linear,),
    qat_module="dal.nn.linear:QLinear",
    onnx=("Gemm", "MatMul", "Add"),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

LAZY_LINEAR = Op(
    name="lazy_linear",
    op_class="linear",
    handling="quantize",
    modules=(nn.LazyLinear,),
    onnx=("Gemm", "MatMul", "Add"),
    spec="§5a",
    cost="matrix",
    fp16_region=("compute",),
)

EMBEDDING = Op(
    name="embedding",
    op_class="embedding",
    handling="quantize",
    modules=(nn.Embedding,),
    qat_module="dal.nn.linear:QEmbedding",
    onnx=("Gather",),
    spec="§5d",
    cost="matrix",
)

EMBEDDING_BAG = Op(
    name="embedding_bag",
    op_class="embedding",
    handling="quantize",
    modules=(nn.EmbeddingBag,),
)

OPS: tuple[Op, ...] = (
    CONV1D, CONV2D, CONV_TRANSPOSE1D, CONV_TRANSPOSE2D, LINEAR, LAZY_LINEAR, EMBEDDING,
    EMBEDDING_BAG,
)
