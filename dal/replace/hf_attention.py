"""Hugging Face transformers attention as the NPU runs it (part of rule ``npu_attention``).

HF attention modules (``LlamaAttention``, ``GPT2Attention``, ...) project, apply the rotary
embedding, update the KV cache, then call the function ``config._attn_implementation`` names in
transformers' ``AttentionInterface`` (``sdpa``, ``eager``, ...) as
``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)``.
Their forwards do not trace with torch.fx, so the SDPA rewrite (``sdpa.py``) never sees them.

Recognised by computation, not by class name: a module with a ``config`` that has
``_attn_implementation`` and whose own ``forward`` reads ``ALL_ATTENTION_FUNCTIONS``.

The replacement is the same module (a copy sharing every Parameter, buffer and submodule; same
class) with a child ``npu_attention``, an :class:`HfNpuAttention`:

    key, value = kv_cache(key, value)       # dal.nn.kv_cache.QKVCache: K/V quantizers (recipe)
    key, value = repeat_kv(key), repeat_kv(value)      # grouped-query attention: heads repeated
    out, P = core(query, key, value, mask)  # NpuAttentionCore: explicit Q @ K^T and P @ V
                                            # (QMatMul after prepare), the hardware's softmax

The model's ``config._attn_implementation`` becomes :data:`DAL_ATTENTION`, registered with
``AttentionInterface`` (the function :func:`dal_attention_forward` routes each call to the
calling module's ``npu_attention``; a module without one gets transformers' own
``sdpa_attention_forward``) and with ``AttentionMaskInterface`` (transformers' ``eager_mask``:
a float additive mask, 0 where attended, ``finfo(float32).min`` where not, always materialised).
The mask stays float arithmetic outside the quantized ops: it is added to the scores before the
softmax (``NpuSoftmax``'s addend); a masked entry weighs exactly 0 in every softmax mode (FP16:
``scores + finfo.min`` casts to ``-inf``; the "lut" table softmax treats entries below ``-1e30``
as masks, ``softmax_lut.py``). A query row with every key masked (a padding query of a padded
batch) would be 0 / 0 = NaN there, and its NaN value vectors would reach every query of the
sequence through ``0 * NaN`` in ``P @ V``: such rows are left unmasked (:func:`unmask_dead_rows`;
their outputs are meaningless but finite, as transformers' eager attention makes them uniform).

``scaling`` is the call's: the query is multiplied by it before ``Q @ K^T`` (float, outside the
quantized ops, where ``NpuAttentionCore`` would; the core's own scale is 1), so modules that scale
the query themselves and pass 1.0 (Whisper) work too; dropout is the call's
(``attention_dropout`` while training, 0 in eval).
Quantizers from the recipe (:func:`attach_quantizers`, called by ``prepare_qat`` after the
replacement): the KV cache's (a rule ``type: kv_cache``, ``dal.nn.kv_cache``), and, as an option
(off by default), the attention probabilities: a rule reaching ``<module>.npu_attention.core.softmax``
as ``type: softmax`` with an ``output:`` spec gives that softmax an output quantizer, in a format
the hardware's softmax writes (``ops.softmax.output_formats``: uint8 / int8 on the a1000; the
a2000 writes fp16 only). ``P @ V``'s input quantizer then reads it as stored. A rule with
``fallback: fp16`` (the bundled recipes' softmax rule) asks for nothing here.

Not supported (refused by the call, naming the module): ``softcap``, ``position_bias``,
attention sinks (``s_aux``). transformers is imported only on this path; ``import dal`` does not.
A model saved with ``save_pretrained`` after prepare carries ``attn_implementation: dal_npu`` in
its config: set it back (``model.config._attn_implementation = "sdpa"``) before saving for use without dal.
"""
from __future__ import annotations

import inspect
from typing import Optional, Union

import torch
import torch.fx
from torch import nn

from ..config.problems import Problem
from ..nn.kv_cache import QKVCache, attach_kv_quantizers
from ..nn.spec import make_quantizer
from ..nn.tree import set_child, shallow_copy
from ..recipe.errors import RecipeError
from .core import NpuAttentionCore

#: the name of dal's function in transformers' AttentionInterface / AttentionMaskInterface
DAL_ATTENTION = "dal_npu"
#: the child an HF attention module gets
CHILD = "npu_attention"
#: additive mask entries below minus this are masked positions (as dal.replace.softmax_lut reads them)
MASKED_BELOW = 1e30
_UNSUPPORTED = ("softcap", "position_bias", "s_aux")


def hf_config_of(module) -> Optional[object]:
    """``module.config`` when it is a transformers configuration (it has the attention
    implementation setting ``_attn_implementation``), else None."""
    config = getattr(module, "config", None)
    return config if config is not None and hasattr(config, "_attn_implementation") else None


def is_hf_attention(module: nn.Module) -> bool:
    """An HF attention module: a transformers ``config`` (:func:`hf_config_of`), and an own forward
    that dispatches through ``ALL_ATTENTION_FUNCTIONS`` (transformers' attention interface)."""
    if hf_config_of(module) is None:
        return False
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def _repeat_kv(x: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``[B, kv_heads, L, d] -> [B, heads, L, d]``, each kv head repeated for its group of query
    heads (transformers' ``repeat_kv``); the tensor itself when the head counts are equal."""
    b, kv_heads, length, d = x.shape
    n_rep = query.shape[1] // kv_heads
    if n_rep == 1:
        return x
    return x[:, :, None].expand(b, kv_heads, n_rep, length, d).reshape(b, kv_heads * n_rep, length, d)


def unmask_dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with every row whose entries are all below ``-MASKED_BELOW`` (no key may be attended
    to) set to 0; other rows unchanged."""
    # amax then one float compare (not ``(mask < -t).all()``, which exports as an int64
    # ReduceSum and compare): the same rows, NaN included, and float nodes only in the file.
    dead = mask.amax(dim=-1, keepdim=True) < -MASKED_BELOW
    return mask.masked_fill(dead, 0.0)


# A leaf for prepare's fx trace: head repetition (a view, exact on codes) needs the shapes.
torch.fx.wrap("_repeat_kv")


class HfNpuAttention(nn.Module):
    """The attention an HF module's attention function computes, as the NPU runs it.

    ``forward(query, key, value, mask=None) -> (out, P)`` on head-split tensors: ``query``
    ``[B, heads, Lq, d]``, ``key`` / ``value`` ``[B, kv_heads, Lk, d]`` (past + new entries of the
    cache), ``mask`` additive, broadcast to ``[B, heads, Lq, Lk]``; ``out`` is ``[B, heads, Lq, d]``.
    ``out = softmax(q @ repeat(K_q)^T + mask) @ repeat(V_q)`` with ``K_q, V_q`` the KV-cache
    quantizers' outputs (identity until a recipe rule asks for them); ``q`` arrives scaled
    (:meth:`attend`), the core's scale is 1.
    """

    def __init__(self, dropout: float = 0.0, softmax_mode: Union[str, bool] = "fp16", name: str = ""):
        super().__init__()
        self.kv_cache = QKVCache(name=f"{name}.kv_cache" if name else "kv_cache")
        self.core = NpuAttentionCore(1.0, dropout, softmax_mode, name=f"{name}.core" if name else "core")

    def forward(self, query, key, value, mask=None):
        key, value = self.kv_cache(key, value)
        return self.core(query, _repeat_kv(key, query), _repeat_kv(value, query), None, mask)

    def attend(self, module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
               scaling: Optional[float] = None, **kwargs):
        """The attention-interface call of ``module`` (its ``npu_attention`` is ``self``):
        ``(out [B, Lq, heads, d], P)`` as transformers' attention functions return."""
        bad = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
        if bad:
            where = self.kv_cache.qat_name.rsplit(".", 2)[0] if self.kv_cache.qat_name.count(".") >= 2 else ""
            raise NotImplementedError(f"{where or '<attention>'} ({type(module).__name__}): "
                                      f"dal's NPU attention does not support {', '.join(bad)}; leave this model's "
                                      "attention out of the npu_attention rule")
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        if scale != 1.0:
            query = query * scale
        if float(dropout) != self.core.dropout.p:
            self.core.dropout.p = float(dropout)
        mask = attention_mask
        if mask is not None and mask.dtype == torch.bool:  # True = attend
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if mask is not None:
            mask = unmask_dead_rows(mask)
        out, p = self(query, key, value, mask)
        return out.transpose(1, 2).contiguous(), p

    def extra_repr(self) -> str:
        return f"attention function {DAL_ATTENTION!r}"


def dal_attention_forward(module: nn.Module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: Optional[float] = None, **kwargs):
    """The function registered as :data:`DAL_ATTENTION`: ``module.npu_attention.attend(...)``,
    or transformers' ``sdpa_attention_forward`` for a module that has no ``npu_attention``."""
    npu = getattr(module, CHILD, None) if isinstance(module, nn.Module) else None
    if isinstance(npu, HfNpuAttention):
        return npu.attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register() -> None:
    """Register :data:`DAL_ATTENTION` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(DAL_ATTENTION, dal_attention_forward)
    AttentionMaskInterface.register(DAL_ATTENTION, eager_mask)


def _dropout_of(module: nn.Module) -> float:
    p = getattr(module, "attention_dropout", None)
    if isinstance(p, (int, float)):
        return float(p)
    drop = getattr(module, "attn_dropout", None)
    return float(drop.p) if isinstance(drop, nn.Dropout) else 0.0


def build_hf_attention(module: nn.Module, softmax_mode: str) -> nn.Module:
    """A copy of HF attention ``module`` (same class; the same Parameters, buffers, submodules and
    config object) with an :class:`HfNpuAttention` child ``npu_attention``; ``module`` is unchanged."""
    new = shallow_copy(module)  # own tables (submodules, hooks): the original stays as it was
    set_child(new, CHILD, HfNpuAttention(_dropout_of(module), softmax_mode, name=CHILD).train(module.training))
    return new


def use_dal_attention(model: nn.Module, module: nn.Module) -> Optional[str]:
    """Switch the attention implementation of ``module``'s config (shared with ``model`` and the
    other layers) to :data:`DAL_ATTENTION`; a note when it changed, else None."""
    register()
    notes = []
    for cfg in {id(c): c for c in (hf_config_of(module), hf_config_of(model)) if c is not None}.values():
        old = cfg._attn_implementation
        if old != DAL_ATTENTION:
            cfg._attn_implementation = DAL_ATTENTION
            notes.append(str(old))
    if not notes:
        return None
    return (f"transformers attention implementation {', '.join(sorted(set(notes)))} -> {DAL_ATTENTION!r} "
            f"(dal.replace.hf_attention: each replaced attention module calls its npu_attention)")


def attach_quantizers(model: nn.Module, recipe, hw=None) -> list[str]:
    """The recipe's quantizers for every :class:`HfNpuAttention` of ``model``: KV cache
    (:func:`dal.nn.kv_cache.attach_kv_quantizers`) and the optional probability quantizer (module
    docstring), checked against ``hw`` first (one ``RecipeError`` naming every path, format and
    the hardware). Returns report notes, one per quantized cache / probability tensor."""
    notes = attach_kv_quantizers(model, recipe, hw)
    if recipe is None:
        return notes
    plans, problems = [], []
    for path, mod in model.named_modules():
        if not isinstance(mod, HfNpuAttention):
            continue
        where = f"{path}.core.softmax" if path else "core.softmax"
        spec = recipe.resolve(where, "NpuSoftmax", "softmax")
        if spec is None or spec.output is None or spec.fallback_fp16:
            continue
        allowed = hw.allowed_formats("softmax", "output") if hw is not None else (spec.output.format,)
        if spec.output.format not in allowed:
            problems.append(Problem(f"{where}: attention probabilities in {spec.output.format.name} are not "
                                    f"written by hardware {hw.name!r}'s softmax (output formats: "
                                    f"{', '.join(f.name for f in allowed) or 'none'})", ("rules", "output"),
                                    spec.rule_source))
        plans.append((where, mod.core.softmax, spec.output))
    if problems:
        raise RecipeError(problems, what=f"recipe {recipe.name!r} for hardware {hw.name!r}")
    for where, softmax, spec in plans:
        softmax.output_quant = make_quantizer(spec, None, f"{where}.output_quant", force_per_tensor=True)
        notes.append(f"{where}: attention probabilities quantized to {spec.format.name} (output_quant)")
    return notes
