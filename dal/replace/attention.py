"""Rule ``npu_attention``: attention as the NPU runs it (int8/fp8 matmuls, FP16 or table softmax).

Matches, top-down (a matched module's submodules are not offered again):

* ``nn.MultiheadAttention`` (batch_first or not; not ``add_bias_kv`` / ``add_zero_attn``)
  -> :class:`~dal.replace.mha.NpuMultiheadAttention`;
* torchvision's ``ShiftedWindowAttention`` / ``ShiftedWindowAttentionV2``
  -> :class:`~dal.replace.swin.NpuShiftedWindowAttention`;
* Hugging Face transformers attention modules (their forward calls the attention interface)
  -> the same module with an :class:`~dal.replace.hf_attention.HfNpuAttention` child, KV-cache
  quantizers included, and the model's attention implementation switched to dal's
  (:mod:`dal.replace.hf_attention`);
* any other module whose own forward calls ``F.scaled_dot_product_attention`` with constant
  options -> the same module with the call rewritten to an :class:`~dal.replace.sdpa.NpuSDPA`.

The softmax mode (:func:`~dal.replace.softmax.softmax_mode`, :class:`~dal.replace.softmax.NpuSoftmax`):

* ``"fp16"`` when the hardware lists ``softmax`` in ``fp16_ops`` (or no hardware is given);
* ``"lut"`` when it lists ``exp`` in ``lut_ops`` and its ``softmax`` op takes int8 inputs
  (e.g. the a1000): int8 input quantizer, ``exp(-s * (c_max - c))`` from a table, normalised;
  the next matmul's uint8 input quantizer quantizes the probabilities;
* ``"float"`` otherwise (float32; the next matmul's quantized input stands for its output).

Exported: MatMul between Q/DQ pairs; Softmax between FP16 casts ("fp16"), after a
QuantizeLinear -> DequantizeLinear pair ("lut"; with masks or biases the DQ output also gets
``Clip(x + 1e30, max=0)``, which zeroes masked entries), or plain ("float").
"""
from __future__ import annotations

from torch import nn

from ..nn.tree import own_slots
from .registry import rule
from .softmax import softmax_mode

_SWIN_TYPES = ("ShiftedWindowAttention", "ShiftedWindowAttentionV2")


def _is_swin(module: nn.Module) -> bool:
    return type(module).__name__ in _SWIN_TYPES and type(module).__module__.startswith("torchvision.")


@rule("npu_attention")
class NpuAttentionRule:
    """nn.MultiheadAttention, torchvision Swin attention and SDPA calls -> NPU attention."""

    def match(self, module: nn.Module, name: str) -> bool:
        if type(module) is nn.MultiheadAttention:
            return module.bias_k is None and not module.add_zero_attn
        if _is_swin(module):
            return True
        from .hf_attention import is_hf_attention

        if is_hf_attention(module):
            return True
        from .sdpa import sdpa_graph

        return sdpa_graph(module) is not None

    def build(self, module: nn.Module, hardware) -> nn.Module:
        mode = softmax_mode(hardware)
        if type(module) is nn.MultiheadAttention:
            from .mha import NpuMultiheadAttention

            return NpuMultiheadAttention(module, mode)
        if _is_swin(module):
            from .swin import NpuShiftedWindowAttention

            return NpuShiftedWindowAttention(module, mode)
        from .hf_attention import build_hf_attention, is_hf_attention

        if is_hf_attention(module):
            return build_hf_attention(module, mode)
        from .sdpa import replace_sdpa

        return replace_sdpa(module, mode)

    def describe(self, module: nn.Module, name: str) -> str:
        from .hf_attention import is_hf_attention

        kind = ("MultiheadAttention" if type(module) is nn.MultiheadAttention else
                "Swin window attention" if _is_swin(module) else
                "transformers attention (its attention-interface call)" if is_hf_attention(module) else
                "scaled_dot_product_attention call(s)")
        return f"{kind}: explicit Q@K^T and P@V matmuls, projections as nn.Linear"

    def after_swap(self, model: nn.Module, path: str, new: nn.Module) -> list[str]:
        notes = []
        from .hf_attention import CHILD, use_dal_attention

        if CHILD in own_slots(new).modules and (note := use_dal_attention(model, new)):
            notes.append(note)
        if getattr(new, "v2", False) and new.zero_unused_key_bias():
            notes.append(f"{path}: qkv.bias k-part zeroed and frozen (torchvision's V2 never uses it)")
        # A TransformerEncoder decided at construction whether to use its nested-tensor fast path,
        # which calls torch's fused kernel with the layers' in_proj weights: switch it off.
        for p, m in model.named_modules():
            if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False) \
                    and any(x is new for x in m.modules()):
                m.use_nested_tensor = False
                notes.append(f"{p or '<root>'}: TransformerEncoder nested-tensor fast path off (attention replaced)")
        return notes

    def why_nothing(self, hardware) -> str:
        return ("no nn.MultiheadAttention, torchvision Swin attention, transformers attention module or feasible "
                "F.scaled_dot_product_attention call")
