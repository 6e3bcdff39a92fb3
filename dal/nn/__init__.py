"""Drop-in QAT modules: the float op plus its input / weight / output fake quantizers."""
from .registry import OP_CLASSES, QAT_MODULES, is_qat_module, qat_class_for, register_qat_module
from .base import QATModule, QWeightedModule, apply_activation
from .linear import QEmbedding, QLinear
from .conv import QConv1d, QConv2d, QConvTranspose2d
from .conv_bn import QConvBn2d, QConvBnReLU2d
from .functional import QAdd, QCat, QMatMul, QMul
from .norm import Fp16GroupNorm, Fp16InstanceNorm2d, QBatchNorm2d
from .spec import SimpleLayerSpec, SimpleTensorSpec, layer_spec, make_quantizer, tensor_spec

__all__ = ["QAT_MODULES", "OP_CLASSES", "register_qat_module", "qat_class_for", "is_qat_module", "QATModule", "QWeightedModule",
           "apply_activation", "QLinear", "QEmbedding", "QConv1d", "QConv2d", "QConvTranspose2d", "QConvBn2d",
           "QConvBnReLU2d", "QAdd", "QMul", "QCat", "QMatMul", "SimpleLayerSpec", "SimpleTensorSpec", "layer_spec", "tensor_spec",
           "make_quantizer", "QBatchNorm2d", "Fp16GroupNorm", "Fp16InstanceNorm2d"]
