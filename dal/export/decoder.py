"""dal.export_decoder: a prepared causal LM -> a static-shape prefill graph and a decode graph.

The contract is export/SPEC.md §5f (decoder graphs). In short (B batch, P prompt length,
L cache length, kv KV heads, d head size, V vocabulary, n layers):

prefill  inputs  ``input_ids [B, P] int64``, ``position_ids [B, P] int64``,
                 ``attention_mask [B, 1, P, P] float32`` (additive: 0 attended, finfo(float32).min masked)
         outputs ``logits [B, P, V] float32``, ``present_key_i`` / ``present_value_i [B, kv, P, d]``
decode   inputs  ``input_ids [B, 1]``, ``position_ids [B, 1]``, ``attention_mask [B, 1, 1, L + 1]``,
                 ``past_key_i`` / ``past_value_i [B, kv, L, d]``
         outputs ``logits [B, 1, V]``, ``present_key_i`` / ``present_value_i [B, kv, 1, d]`` (the new entry)

Every ``past_*`` / ``present_*`` tensor holds the codes of the layer's KV-cache quantizer (int8,
uint8 or float8 element type) with that quantizer's scale and zero point: a ``past`` input feeds
``DequantizeLinear(scale, zero_point)``; a prefill ``present`` output is the quantizer's
``QuantizeLinear`` output itself, a decode one the new entry's codes (``QuantizeLinear`` of its
dequantized value with the same scale and zero point: the same codes). The host keeps the
cache: it writes the prefill's P entries to slots ``0 .. P-1`` and each decode step's entry to
the slot its position names, and masks the slots not written yet (:mod:`dal.verification.generate_check` does this).
"""
from __future__ import annotations

import json
import os
from collections import deque
from typing import Optional, Union

import onnx
import torch
from torch import nn

from .api import export_onnx
from .decoder_module import DecoderStep, decoder_parts
from .errors import ExportError
from .graph import Graph

#: the additive mask value of a masked position (what transformers' eager mask writes)
MASKED = float(torch.finfo(torch.float32).min)
_PREFIX = "lm."  # DecoderStep's child holding the model
_PASS = {"Slice", "Identity", "Reshape", "Squeeze", "Unsqueeze"}


def causal_mask(valid: torch.Tensor, queries: int, decode: bool) -> torch.Tensor:
    """The additive mask for ``valid`` ``[B, K']`` (True: a key slot holding an entry).

    prefill (``K' = P``): query ``i`` attends to key ``j`` iff ``j <= i`` and ``valid[:, j]``;
    decode (``K' = L``, one query): to every valid past slot and to the new key (appended last).
    Returns ``[B, 1, queries, K]`` float32, 0 attended and :data:`MASKED` elsewhere.
    """
    valid = valid.bool()
    b, k = valid.shape
    if decode:
        keep = torch.cat([valid, valid.new_ones(b, 1)], dim=1)[:, None, None, :]
    else:
        causal = torch.ones(queries, k, dtype=torch.bool).tril()
        keep = causal[None, None] & valid[:, None, None, :]
    return torch.zeros(keep.shape, dtype=torch.float32).masked_fill(~keep, MASKED)


def example_inputs(model: nn.Module, prompt_len: int, cache_len: int, batch: int, decode: bool) -> tuple:
    """Inputs of a step's shapes (values: a causal prompt at positions 0.., an empty float cache),
    for tracing :class:`DecoderStep`."""
    parts = decoder_parts(model)
    dev = next(model.parameters()).device
    if not decode:
        valid = torch.ones(batch, prompt_len, dtype=torch.bool)
        return (torch.zeros(batch, prompt_len, dtype=torch.long, device=dev),
                torch.arange(prompt_len, device=dev).expand(batch, prompt_len).contiguous(),
                causal_mask(valid, prompt_len, False).to(dev))
    attn = parts["attn"][0]
    kv_heads = attn.config.num_key_value_heads
    d = attn.head_dim
    past = [torch.zeros(batch, kv_heads, cache_len, d, device=dev) for _ in range(2 * len(parts["layers"]))]
    valid = torch.zeros(batch, cache_len, dtype=torch.bool)
    return (torch.zeros(batch, 1, dtype=torch.long, device=dev), torch.zeros(batch, 1, dtype=torch.long, device=dev),
            causal_mask(valid, 1, True).to(dev), *past)


def io_names(n_layers: int, decode: bool) -> tuple[list[str], list[str]]:
    """``(input names, output names)`` of a step graph (module docstring)."""
    kv = [f"{{}}_{kind}_{i}" for i in range(n_layers) for kind in ("key", "value")]
    ins = ["input_ids", "position_ids", "attention_mask"] + ([x.format("past") for x in kv] if decode else [])
    return ins, ["logits"] + [x.format("present") for x in kv]


def _check_kv(model: nn.Module) -> None:
    bad = []
    for i, kv in enumerate(decoder_parts(model)["kv"]):
        for role, q in (("key", kv.key_quant), ("value", kv.value_quant)):
            if q is None or q.state == "off" or not q.fmt.is_scaled:
                what = "none" if q is None else (q.state if q.state == "off" else q.fmt.name)
                bad.append(f"model.layers.{i}.self_attn.npu_attention.kv_cache.{role}_quant ({what})")
    if bad:
        raise ExportError("export_decoder: the KV cache crosses the graph boundary as integer or FP8 codes, so every "
                          "layer needs a scaled KV-cache quantizer (a recipe rule {type: kv_cache, input: {format: "
                          "int8 | fp8_e4m3 ...}}); not quantized: " + ", ".join(bad))


def _codes_boundary(proto: onnx.ModelProto, n_layers: int, decode: bool) -> None:
    """Rewrite the traced float cache tensors to codes: each ``past`` input becomes the codes
    feeding a DequantizeLinear with its layer's KV quantizer's scale / zero point; each
    ``present`` output becomes that quantizer's QuantizeLinear output (sliced as the float was)."""
    graph = Graph(proto)
    g = proto.graph
    producers, consumers = graph.producers(), graph.consumers()
    for o in list(g.output)[1:]:
        chain, name = [], o.name
        while producers.get(name) is not None and producers[name].op_type in _PASS:
            chain.append(producers[name])
            name = producers[name].input[0]
        dq = producers.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or producers.get(dq.input[0]) is None \
                or producers[dq.input[0]].op_type != "QuantizeLinear":
            raise ExportError(f"export_decoder: graph output {o.name} is not a KV-cache quantizer's output "
                              f"(found {dq.op_type if dq is not None else 'a graph input'})")
        codes = dq.input[0]
        if chain:  # decode: the new entry sliced from the dequantized cache, quantized again with the
            # same scale and zero point: the same codes (Q(DQ(c)) == c), and Slice takes no float8
            codes = graph.fresh(f"{o.name}.codes")
            requant = graph.make_node("QuantizeLinear", [o.name, *dq.input[1:3]], [codes], f"{o.name}.quantize")
            requant.attribute.extend(_axis_of(dq))
            graph.nodes.append(requant)
        graph.outputs.discard(o.name)
        graph.outputs.add(codes)
        o.name = codes
        o.type.tensor_type.elem_type = _elem_of(graph, dq)
    if decode:
        for i, inp in enumerate(list(g.input)[3:]):
            q = _first_quantize(inp.name, consumers)
            if q is None:
                raise ExportError(f"export_decoder: past input {inp.name} reaches no KV-cache QuantizeLinear")
            codes = graph.fresh(f"{inp.name}.codes")
            # first: Graph's liveness pass walks the node list backwards, producers before consumers
            deq = graph.make_node("DequantizeLinear", [codes, q.input[1], q.input[2]], [inp.name],
                                  f"{inp.name}.dequantize")
            deq.attribute.extend(_axis_of(q))
            graph.nodes.insert(0, deq)
            inp.name = codes
            inp.type.tensor_type.elem_type = _elem_of(graph, q)
    graph.finish()


def _axis_of(qdq: onnx.NodeProto) -> list:
    """The ``axis`` attribute of a Q / DQ node (a per-head cache scale), as a list to extend with."""
    return [a for a in qdq.attribute if a.name == "axis"]


def _elem_of(graph: Graph, qdq: onnx.NodeProto) -> int:
    """The ONNX element type of a Q / DQ node's codes: its zero point's."""
    zp = graph.inits.get(qdq.input[2]) if len(qdq.input) > 2 else None
    if zp is None:
        raise ExportError(f"export_decoder: {qdq.name} has no zero-point initializer to type the cache codes")
    return zp.data_type


def _first_quantize(name: str, consumers: dict) -> Optional[onnx.NodeProto]:
    """The first QuantizeLinear downstream of ``name`` through Concat / shape-only nodes."""
    todo, seen = deque([name]), set()
    while todo:
        t = todo.popleft()
        for node in consumers.get(t, []):
            if node.name in seen:
                continue
            seen.add(node.name)
            if node.op_type == "QuantizeLinear":
                return node
            if node.op_type in _PASS | {"Concat"}:
                todo.extend(node.output)
    return None


def _rename(proto: onnx.ModelProto, names_in: list[str], names_out: list[str]) -> None:
    """Graph inputs / outputs get ``names_in`` / ``names_out``; every other name loses the
    ``lm.`` prefix of DecoderStep's child, so quantizers, weights and nodes carry the model's own
    module paths (``model.layers.0.mlp.up_proj.input_quant``), as in dal.export_onnx's files."""
    g = proto.graph
    rename = {i.name: n for i, n in zip(g.input, names_in)}
    rename.update({o.name: n for o, n in zip(g.output, names_out)})

    def new(x: str) -> str:
        return rename.get(x, x[len(_PREFIX):] if x.startswith(_PREFIX) else x)

    for node in g.node:
        node.input[:] = [new(x) for x in node.input]
        node.output[:] = [new(x) for x in node.output]
        node.name = new(node.name)
    for item in (*g.input, *g.output, *g.initializer):
        item.name = new(item.name)
    for prop in proto.metadata_props:  # dal.sparse_24 names codes initializers: renamed with them
        if prop.key == "dal.sparse_24" and prop.value:
            prop.value = json.dumps({new(k): v for k, v in json.loads(prop.value).items()}, sort_keys=True)


def export_decoder(model: nn.Module, path_prefix: Union[str, os.PathLike], *, prompt_len: int, cache_len: int,
                   batch: int = 1, opset: Optional[int] = None) -> tuple[str, str]:
    """Export a calibrated / trained causal LM as two static-shape QDQ graphs; return their paths
    ``(<path_prefix>.prefill.onnx, <path_prefix>.decode.onnx)``.

    Inputs and outputs are in the module docstring and export/SPEC.md §5f. Both
    files otherwise follow :func:`dal.export_onnx`'s contract (blocked INT4 weights, QDQ
    activations, FP16 islands, metadata); ``dal.decoder.*`` metadata records P, L, batch and the
    layer count. Needs ``replace: [npu_attention]`` and a ``kv_cache`` rule with an integer or FP8
    format (ExportError naming every layer without one). ``prompt_len`` >= 1 and ``cache_len`` >=
    ``prompt_len``.

    Example:
        >>> pre, dec = dal.export_decoder(model, "tiny", prompt_len=8, cache_len=16)
    """
    prompt_len, cache_len, batch = int(prompt_len), int(cache_len), int(batch)
    if prompt_len < 1 or cache_len < prompt_len or batch < 1:
        raise ExportError(f"export_decoder: need prompt_len >= 1, cache_len >= prompt_len, batch >= 1; got "
                          f"prompt_len={prompt_len}, cache_len={cache_len}, batch={batch}")
    _check_kv(model)
    n_layers = len(decoder_parts(model)["layers"])
    paths = []
    for decode in (False, True):
        step = DecoderStep(model, cache_len, decode)
        args = example_inputs(model, prompt_len, cache_len, batch, decode)
        names_in, names_out = io_names(n_layers, decode)
        meta = {"dal.decoder.graph": "decode" if decode else "prefill", "dal.decoder.prompt_len": str(prompt_len),
                "dal.decoder.cache_len": str(cache_len), "dal.decoder.batch": str(batch),
                "dal.decoder.layers": str(n_layers)}
        proto = export_onnx(step, args, None, opset=opset, metadata=meta)
        _codes_boundary(proto, n_layers, decode)
        _rename(proto, names_in, names_out)
        onnx.checker.check_model(proto, full_check=True)
        path = f"{os.fspath(path_prefix)}.{'decode' if decode else 'prefill'}.onnx"
        onnx.save(proto, path)
        paths.append(path)
    return paths[0], paths[1]


def decoder_step(model: nn.Module, onnx_path: Union[str, os.PathLike, onnx.ModelProto]) -> nn.Module:
    """The torch module that takes and returns what the decoder file ``onnx_path`` does (its
    prefill or decode step, cache length from the file's ``dal.decoder.*`` metadata, the KV cache
    as codes): what ``dal.verify(onnx_path, decoder_step(model, onnx_path), inputs)`` and
    ``dal.convert`` pair with the file element for element.

    Example:
        >>> report = dal.verify(dec, decoder_step(model, dec), (ids, pos, mask, *past_codes))
    """
    from .decoder_module import CodesStep

    proto = onnx_path if isinstance(onnx_path, onnx.ModelProto) else onnx.load(os.fspath(onnx_path))
    meta = {p.key: p.value for p in proto.metadata_props}
    if "dal.decoder.graph" not in meta:
        where = "the model" if isinstance(onnx_path, onnx.ModelProto) else os.fspath(onnx_path)
        raise ExportError(f"decoder_step: {where} has no "
                          "dal.decoder.* metadata; give a file dal.export_decoder wrote")
    return CodesStep(DecoderStep(model, int(meta["dal.decoder.cache_len"]), meta["dal.decoder.graph"] == "decode"))
