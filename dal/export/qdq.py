"""Scaled placeholders (integer and FP8 formats) -> QuantizeLinear / DequantizeLinear.

* on an activation:  ``x -> QuantizeLinear(s, zp) -> DequantizeLinear(s, zp) -> y``
* on a constant (a weight, already BN-folded and masked by constant folding):
  ``codes (typed initializer) -> DequantizeLinear(s, zp) -> y``; a Transpose that only
  re-lays the weight out (``F.linear`` on 3-D inputs becomes MatMul(x, Transpose(W))) is folded
  into the stored codes so the matrix engine sees ``DQ -> MatMul`` directly.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx

from .graph import Graph
from .qparams import QParams, qparams_of, quantize_constant
from .trace import PLACEHOLDER_DOMAIN, PLACEHOLDER_OP, Site


@dataclass
class DQInfo:
    """What a DequantizeLinear output carries (read by the bias and metadata passes)."""

    site: Site
    qparams: QParams
    weight: Optional[str] = None          # initializer of the stored codes (constants only)
    codes: Optional[np.ndarray] = None
    perm: Optional[tuple[int, ...]] = None  # transpose folded into the stored codes


def is_placeholder(node: onnx.NodeProto) -> bool:
    return node.domain == PLACEHOLDER_DOMAIN and node.op_type == PLACEHOLDER_OP


def site_of(node: onnx.NodeProto, sites: dict[int, Site]) -> Site:
    sid = next(a.i for a in node.attribute if a.name == "site")
    return sites[sid]


class _ParamInits:
    """Scale / zero-point initializers, shared by every call of one quantizer with equal values."""

    def __init__(self, graph: Graph):
        self.graph, self.cache = graph, {}

    def get(self, base: str, p: QParams) -> tuple[str, str]:
        key = (base, p.scale.tobytes(), p.scale.shape, p.zero_point.tobytes(), str(p.zero_point.dtype))
        if key not in self.cache:
            self.cache[key] = (self.graph.add_init(f"{base}.scale", p.scale),
                               self.graph.add_init(f"{base}.zero_point", p.zero_point))
        return self.cache[key]


def rewrite_scaled(graph: Graph, sites: dict[int, Site]) -> dict[str, DQInfo]:
    """Replace every integer / FP8 placeholder; return {DQ output name: DQInfo}."""
    producers, consumers = graph.producers(), graph.consumers()
    params = _ParamInits(graph)
    infos: dict[str, DQInfo] = {}
    narrow_acts = []
    new_nodes, dropped = [], set()
    for node in graph.nodes:
        if id(node) in dropped:
            continue
        if not (is_placeholder(node) and site_of(node, sites).quantizer.fmt.is_scaled):
            new_nodes.append(node)
            continue
        site = site_of(node, sites)
        q, name = site.quantizer, site.entry.name
        x, y = node.input[0], node.output[0]
        value = graph.const(x, producers)
        if value is None:  # activation: Q -> DQ
            p = qparams_of(q, site.shape)
            s, zp = params.get(name, p)
            if p.narrow_range and p.fmt.is_integer and p.fmt.signed:
                narrow_acts.append(name)
            qa = dict(p.attrs())
            if p.fmt.is_float8:
                qa["saturate"] = 1
            codes = graph.fresh(f"{name}.quantized")
            new_nodes.append(graph.make_node("QuantizeLinear", [x, s, zp], [codes], f"{name}/QuantizeLinear", **qa))
            new_nodes.append(graph.make_node("DequantizeLinear", [codes, s, zp], [y], f"{name}/DequantizeLinear",
                                             **p.attrs()))
            infos[y] = DQInfo(site, p)
            continue
        # constant: typed codes -> DQ (folding a following layout-only Transpose)
        p = qparams_of(q, tuple(value.shape))
        codes = quantize_constant(q, value)
        perm, users = None, consumers.get(y, [])
        if len(users) == 1 and users[0].op_type == "Transpose" and y not in graph.outputs:
            t = users[0]
            perm = tuple(next((list(a.ints) for a in t.attribute if a.name == "perm"),
                              list(range(codes.ndim))[::-1]))
            codes, p = np.ascontiguousarray(codes.transpose(perm)), p.permuted(perm)
            dropped.add(id(t))
            y = t.output[0]
        w = graph.add_init(f"{name}.codes", codes)
        s, zp = params.get(name, p)
        new_nodes.append(graph.make_node("DequantizeLinear", [w, s, zp], [y], f"{name}/DequantizeLinear",
                                         **p.attrs()))
        infos[y] = DQInfo(site, p, weight=w, codes=codes, perm=perm)
    graph.nodes = [n for n in new_nodes if id(n) not in dropped]
    if narrow_acts:
        warnings.warn(
            "narrow_range activation quantizers export as full-range QuantizeLinear (ONNX has no narrow "
            f"range): the most negative code can appear where training clipped to -qmax: {', '.join(narrow_acts)}",
            stacklevel=3)
    return infos
