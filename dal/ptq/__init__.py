"""Post-training quantization algorithms and the PTQ-first flow (``dal.auto_quantize``).

Float-model steps (apply before ``prepare_qat``): ``fold_batchnorm``, ``equalize`` (cross-layer
equalization), ``smooth_quant`` (LayerNorm -> Linear scale migration). Quantized-model steps
(after ``dal.calibrate``): ``adaround``, ``bias_correction``, ``reestimate_bn``, ``gptq``,
``sparsegpt`` (2:4 pruning jointly with the weight quantization).
``quantize_ptq`` runs a recipe's ``ptq:`` list; ``auto_quantize`` climbs the ladder.
Every step leaves standard Q/DQ for the exporter: only weights, biases and scales change.
"""
from .rounding import AdaRoundReport, adaround, learned_codes, rectified_sigmoid
from .auto import auto_quantize
from .bias import bias_correction
from .bn_reestimate import reestimate_bn
from .equalization import ChannelClip, equalization_pairs, equalize
from .flow import quantize_ptq, scales_only
from .fold_bn import fold_batchnorm
from .gptq import gptq
from .rungs import AutoQuantizeError, AutoQuantResult, Rung
from .smoothquant import smooth_quant
from .sparsegpt import sparsegpt

__all__ = ["adaround", "AdaRoundReport", "learned_codes", "rectified_sigmoid", "auto_quantize", "bias_correction",
           "reestimate_bn", "equalize", "equalization_pairs", "ChannelClip", "quantize_ptq", "scales_only",
           "fold_batchnorm", "smooth_quant", "AutoQuantizeError", "AutoQuantResult", "Rung", "gptq", "sparsegpt"]
