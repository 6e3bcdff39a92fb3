"""Operator auto-replacement (AT): swap in the hardware's own operators before training.

    import dal
    report = dal.replace.auto_replace(model, rules=["npu_attention", "lut_activation"],
                                      hardware="a2000", example_inputs=(x,))
    print(report)                      # each replacement, its path and output drift

    @dal.replace.rule("my_rule")       # a user rule: match(module, name) / build(module, hw)
    class MyRule: ...

Built-in rules (see each module): ``npu_attention`` (attention.py; Hugging Face attention and
its KV-cache quantizers: hf_attention.py), ``lut_activation``
(lut.py), ``layernorm_fp16`` (layernorm.py), ``conv_bn_relu`` (conv_bn_relu.py, report only),
``upsample_nearest`` (resize.py). ``prepare_qat`` applies a recipe's ``replace:`` list.
Names resolve on first use: importing this package does not import the rules.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "rule": ("registry", "rule"), "RULES": ("registry", "RULES"), "known_rules": ("registry", "known_rules"),
    "get_rules": ("registry", "get_rules"), "auto_replace": ("auto", "auto_replace"),
    "ReplaceReport": ("report", "ReplaceReport"), "Replacement": ("report", "Replacement"),
    "RuleFailure": ("report", "RuleFailure"),
    "NpuAttentionCore": ("core", "NpuAttentionCore"), "NpuSoftmax": ("softmax", "NpuSoftmax"),
    "softmax_mode": ("softmax", "softmax_mode"),
    "NpuMultiheadAttention": ("mha", "NpuMultiheadAttention"),
    "NpuShiftedWindowAttention": ("swin", "NpuShiftedWindowAttention"), "NpuSDPA": ("sdpa", "NpuSDPA"),
    "HfNpuAttention": ("hf_attention", "HfNpuAttention"),
    "LutActivation": ("lut", "LutActivation"), "QLutActivation": ("lut", "QLutActivation"),
    "Fp16LayerNorm": ("layernorm", "Fp16LayerNorm"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
