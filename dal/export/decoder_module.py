"""One static-shape step of a prepared Hugging Face decoder, as the module the exporter traces.

:class:`DecoderStep` calls the model's own submodules (embedding, decoder layers, final norm,
``lm_head``) with everything transformers would compute from int64 arithmetic given as tensors:

    forward(input_ids [B, S] int64, position_ids [B, S] int64, mask [B, 1, S, K] float32,
            *past)                       # decode: past_key_0, past_value_0, ... [B, kv, L, d] float32
        -> (logits [B, S, V], key_0, value_0, key_1, ...)

* rotary embedding: ``cos = cos_table[position_ids]``, ``sin = sin_table[position_ids]``, the
  tables ``[L, d]`` computed once by the model's own rotary module for positions ``0 .. L-1``
  (a Gather in the graph: no Cos / Sin / int64 arithmetic on the chip);
* ``mask`` is added to the attention scores as is (0 attended, ``finfo(float32).min`` masked);
* the KV cache is an explicit object handed to each attention module (its ``cache.update`` /
  ``past_key_values.update``): prefill (``past`` empty) attends over the ``S = P`` new keys,
  ``K = P``; decode (``S = 1``) over ``cat(past, new)``, ``K = L + 1``, the new key last;
* the returned ``key_i`` / ``value_i`` are the layer's KV-cache quantizer outputs (QKVCache):
  all ``P`` entries in prefill, the new entry (``[B, kv, 1, d]``) in decode.

The graph-boundary form (codes in and out, DequantizeLinear) is written by
:mod:`dal.export.decoder`; this module only computes in float what those codes stand for.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from .errors import ExportError


def decoder_parts(model: nn.Module) -> dict:
    """The submodules of a causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...):
    ``embed``, ``layers``, ``norm``, ``rotary``, ``lm_head``, ``attn`` (each layer's attention)
    and ``kv`` (each layer's QKVCache). ExportError naming what is missing."""
    base = getattr(model, "model", None)
    parts = {"embed": getattr(base, "embed_tokens", None), "layers": getattr(base, "layers", None),
             "norm": getattr(base, "norm", None), "rotary": getattr(base, "rotary_emb", None),
             "lm_head": getattr(model, "lm_head", None)}
    missing = [k for k, v in parts.items() if v is None]
    if missing:
        raise ExportError(f"export_decoder: {type(model).__name__} is not a causal LM with model.embed_tokens, "
                          f"model.layers, model.norm, model.rotary_emb and lm_head (missing: {', '.join(missing)})")
    attn, kv = [], []
    for i, layer in enumerate(parts["layers"]):
        a = getattr(layer, "self_attn", None)
        cache = getattr(getattr(a, "npu_attention", None), "kv_cache", None)
        if cache is None:
            raise ExportError(f"export_decoder: model.layers.{i}.self_attn has no npu_attention.kv_cache; "
                              "prepare the model with a recipe that has replace: [npu_attention]")
        attn.append(a)
        kv.append(cache)
    return {**parts, "attn": attn, "kv": kv}


class _Cache:
    """What an HF attention module calls ``update`` on: ``(past ++ new)`` per layer (no state kept)."""

    def __init__(self, past: Optional[list]):
        self.past = past

    def update(self, key, value, layer_idx, *args, **kwargs):
        if self.past is None:
            return key, value
        pk, pv = self.past[2 * layer_idx], self.past[2 * layer_idx + 1]
        return torch.cat([pk, key], dim=2), torch.cat([pv, value], dim=2)


def _cache_kwarg(attn: nn.Module) -> str:
    """The name under which this transformers version's attention forward takes the cache."""
    params = inspect.signature(inspect.unwrap(type(attn).forward)).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in params:
            return name
    raise ExportError(f"export_decoder: {type(attn).__name__}.forward takes no cache argument "
                      f"(parameters: {list(params)})")


class DecoderStep(nn.Module):
    """A prefill (``decode=False``) or decode step of ``model`` (module docstring); shares every
    Parameter and quantizer with ``model``, adds the rotary tables ``[cache_len, d]`` as buffers."""

    def __init__(self, model: nn.Module, cache_len: int, decode: bool):
        super().__init__()
        self.lm = model
        self.decode = bool(decode)
        parts = decoder_parts(model)
        probe = next(model.parameters())
        pos = torch.arange(int(cache_len), device=probe.device)[None]
        with torch.no_grad():
            cos, sin = parts["rotary"](probe.new_zeros(1, dtype=torch.float32), pos)
        self.register_buffer("cos_table", cos[0].float().clone(), persistent=False)
        self.register_buffer("sin_table", sin[0].float().clone(), persistent=False)
        self._kw = _cache_kwarg(parts["attn"][0])

    def keep_kv_hooks(self) -> None:
        """Register the KV quantizers' output hooks once, for good, instead of on every call (a step
        captured by ``torch.compile``, dal/convert/compiled.py, cannot register hooks inside its graph).
        The hooks stay on the quantizers of ``self.lm`` (they collect only while this step's forward
        runs), so call it only on a step whose model is its own (dal.convert's copy) and not changed
        afterwards. Idempotent."""
        if self.__dict__.get("_kv_box") is not None:
            return
        box: list = [None]

        def collect(m, a, out):
            if box[0] is not None:
                box[0].append(out)
        for kv in decoder_parts(self.lm)["kv"]:
            kv.register_forward_hook(collect)
        self.__dict__["_kv_box"] = box

    def forward(self, input_ids, position_ids, mask, *past):
        # looked up at every call: dal.convert swaps submodules of a copy of this module
        parts = decoder_parts(self.lm)
        if self.decode and len(past) != 2 * len(parts["layers"]):
            raise ExportError(f"decode step: {len(past)} past tensors for {len(parts['layers'])} layers "
                              "(past_key_i, past_value_i per layer)")
        seen: list = []
        box = self.__dict__.get("_kv_box")
        if box is not None:  # hooks kept (:meth:`keep_kv_hooks`): no registration in the step
            box[0] = seen
            hooks = []
        else:
            hooks = [kv.register_forward_hook(lambda m, a, out: seen.append(out)) for kv in parts["kv"]]
        try:
            h = parts["embed"](input_ids)
            emb = (self.cos_table[position_ids].to(h.dtype), self.sin_table[position_ids].to(h.dtype))
            cache = _Cache(list(past) if self.decode else None)
            for layer in parts["layers"]:
                h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=emb,
                          use_cache=True, **{self._kw: cache})
                h = h[0] if isinstance(h, tuple) else h
            logits = parts["lm_head"](parts["norm"](h))
        finally:
            for hk in hooks:
                hk.remove()
            if box is not None:
                box[0] = None
        out = [logits]
        for k, v in seen:
            if self.decode:
                k, v = k[:, :, -1:], v[:, :, -1:]
            out += [k, v]
        return tuple(out)


class CodesStep(nn.Module):
    """A :class:`DecoderStep` with the exported graph's boundary: ``past`` inputs are the KV
    quantizers' codes (dequantized here as DequantizeLinear does, ``(c - zp) * s``), the
    ``key_i`` / ``value_i`` outputs their codes (``quantize`` with the same scale and zero point,
    exact on values already on the grid). Takes and returns what the decoder files do, so
    ``dal.convert(CodesStep(...))`` and dal.verify pair with the files element for element."""

    def __init__(self, step: DecoderStep):
        super().__init__()
        self.step = step

    def _quantizers(self) -> list:
        return [q for kv in decoder_parts(self.step.lm)["kv"] for q in (kv.key_quant, kv.value_quant)]

    def _check_past(self, qs: list, past: tuple) -> None:
        """ValueError naming the first ``past_<key|value>_<layer>`` whose count, element type or
        cache length (axis 2) is not the decode graph's."""
        if len(past) != len(qs):
            raise ValueError(f"decode step: {len(past)} past tensors, the graph takes {len(qs)} "
                             "(past_key_i, past_value_i per layer)")
        length = self.step.cos_table.shape[0]
        for k, (q, c) in enumerate(zip(qs, past)):
            name = f"past_{'key' if k % 2 == 0 else 'value'}_{k // 2}"
            want = getattr(torch, q.fmt.torch_storage)
            if c.dtype != want:
                raise ValueError(f"decode step: {name} must hold {q.fmt.name} codes ({want}), got {c.dtype}")
            if c.ndim != 4 or c.shape[2] != length:
                raise ValueError(f"decode step: {name} must be [B, kv_heads, {length}, head_dim] (cache length "
                                 f"{length}), got {list(c.shape)}")

    def codes_in(self, past: tuple) -> list:
        """The ``past`` codes (checked in decode) dequantized as DequantizeLinear does: ``(c - zp) * s``."""
        from ..formats import dequantize
        qs = self._quantizers()
        if self.step.decode:
            self._check_past(qs, past)
        floats = []
        for q, c in zip(qs, past):
            s, zp = q.effective_qparams()
            floats.append(dequantize(c, q.fmt, s.float(), zp, q.granularity))
        return floats

    def codes_out(self, out: tuple) -> tuple:
        """``(logits, codes of key_0, value_0, ...)``: the step's KV outputs quantized (QuantizeLinear)."""
        from ..formats import quantize
        codes = []
        for q, t in zip(self._quantizers(), out[1:]):
            s, zp = q.effective_qparams()
            codes.append(quantize(t, q.fmt, s.float(), zp, q.granularity))
        return (out[0], *codes)

    def forward(self, input_ids, position_ids, mask, *past):
        return self.codes_out(self.step(input_ids, position_ids, mask, *self.codes_in(past)))
