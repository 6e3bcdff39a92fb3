"""Biases of integer layers -> int32 initializer + DequantizeLinear (scale = s_in * s_w).

The QAT modules (``dal.nn.QATModule``) fake-quantize the bias to int32 with
``scale = float32(s_in) * float32(s_w)`` whenever input and weight are integer-quantized; constant
folding leaves that float bias in the graph. Here it becomes what integer hardware stores:
``b_q = round_half_even(b / scale)`` (int32, zero point 0) and ``DequantizeLinear(b_q, scale)``,
per output channel (axis 0) when the weight is. The float bias is on that grid already, so the
dequantized value equals the trained one bit for bit; a module that says ``bias_mode == "int32"``
but whose bias is off the grid is a disagreement between model and exporter, and is refused.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..formats import INT32, PER_TENSOR, dequantize, per_channel, quantize
from .errors import ExportError
from .graph import Graph
from .qdq import DQInfo


def _attr(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return a.i
    return default


def _out_axis(node, w: DQInfo) -> Optional[int]:
    """Axis of the stored weight that indexes output channels, for this consumer."""
    rank = w.codes.ndim
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1 if _attr(node, "group", 1) == 1 else None
    if node.op_type == "Gemm":
        return 0 if _attr(node, "transB", 0) else 1
    if node.op_type == "MatMul":
        return rank - 1
    return None


def _sites(graph: Graph, infos: dict[str, DQInfo]):
    """(consumer node, bias input index, activation DQ, weight DQ) for each biased integer layer."""
    producers = graph.producers()
    for node in graph.nodes:
        if node.op_type in ("Conv", "ConvTranspose", "Gemm") and len(node.input) > 2 and node.input[2]:
            yield node, 2, infos.get(node.input[0]), infos.get(node.input[1])
        elif node.op_type == "Add":
            for k in (0, 1):
                mm = producers.get(node.input[1 - k])
                if mm is not None and mm.op_type == "MatMul" and graph.const(node.input[k], producers) is not None:
                    yield node, k, infos.get(mm.input[0]), infos.get(mm.input[1]), mm
                    break


def rewrite_biases(graph: Graph, infos: dict[str, DQInfo]) -> None:
    """Replace each on-grid float bias of an integer layer by ``DequantizeLinear(int32 codes, s_in * s_w)``."""
    producers = graph.producers()
    new_before = {}
    for found in list(_sites(graph, infos)):
        node, k, a, w = found[:4]
        op = found[4] if len(found) > 4 else node
        if a is None or w is None or a.weight is not None or w.weight is None:
            continue
        if not (a.qparams.fmt.is_integer and w.qparams.fmt.is_integer):
            continue
        owner = w.site.entry.owner
        mode = getattr(owner, "bias_mode", None)
        if mode == "float":
            continue
        if a.qparams.axis is not None or w.qparams.block_size:
            continue  # per-channel activations / per-group weights: the bias stays float (SPEC)
        bias = graph.const(node.input[k], producers)
        axis = _out_axis(op, w)
        if bias is None or bias.dtype != np.float32 or axis is None:
            continue
        if bias.ndim != 1 and bias.size != bias.shape[-1]:
            continue
        n_out = w.codes.shape[axis]
        if bias.size != n_out or (w.qparams.axis is not None and w.qparams.axis != axis):
            continue
        scale = np.float32(a.qparams.scale.reshape(())) * w.qparams.scale.reshape(-1).astype(np.float32)
        scale = scale.astype(np.float32)
        b = bias.reshape(-1)
        # dal.formats' int32 quantizer: the formula the QAT module's fake quantizer trained with
        gran = per_channel(0) if scale.size > 1 else PER_TENSOR
        s_t = torch.from_numpy(scale if scale.size > 1 else scale.reshape(()))
        # a copy: graph.const() arrays view the initializer's bytes (read-only; torch warns on those)
        q_t = quantize(torch.from_numpy(np.array(b, dtype=np.float32)), INT32, s_t, granularity=gran)
        back = dequantize(q_t, INT32, s_t, granularity=gran).numpy()
        codes = q_t.numpy()
        on_grid = np.array_equal(back, b)
        if not on_grid:
            if mode == "int32":
                bad = int(np.sum(back != b))
                raise ExportError(
                    f"{w.site.entry.owner_name}: bias_mode='int32' but {bad} of {b.size} bias values are not "
                    "multiples of s_in * s_w, so the model did not train with the int32 bias the file would "
                    "hold; set bias_mode='float' or re-run the model's forward with its quantizers frozen")
            continue
        base = f"{w.site.entry.owner_name or 'bias'}.bias"
        q = graph.add_init(f"{base}.codes", codes.astype(np.int32, copy=False))
        channelwise = scale.size > 1
        s = graph.add_init(f"{base}.scale", scale if channelwise else scale.reshape(()))
        zp = graph.add_init(f"{base}.zero_point", np.zeros(scale.shape if channelwise else (), np.int32))
        out = graph.fresh(f"{base}.dequantized")
        attrs = {"axis": 0} if channelwise else {}
        dq = graph.make_node("DequantizeLinear", [q, s, zp], [out], f"{base}/DequantizeLinear", **attrs)
        if bias.ndim != 1:
            # the bias broadcast as [..., 1, n]: reshape the dequantized vector back
            shape = graph.add_init(f"{base}.shape", np.array(bias.shape, dtype=np.int64))
            flat, out = out, graph.fresh(f"{base}.reshaped")
            new_before.setdefault(id(node), []).append(dq)
            dq = graph.make_node("Reshape", [flat, shape], [out], f"{base}/Reshape")
        new_before.setdefault(id(node), []).append(dq)
        node.input[k] = out
    if new_before:
        nodes = []
        for n in graph.nodes:
            nodes.extend(new_before.get(id(n), []))
            nodes.append(n)
        graph.nodes = nodes
