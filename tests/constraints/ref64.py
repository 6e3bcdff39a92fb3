"""A float64 model of one integer group of a QDQ file, written from the rules in
dal/npu/metadata.py's docstring (not from dal.npu's code): DQ(x) -> Conv|Gemm|MatMul [-> Relu]
-> Q, with the declared accumulator (saturate / wrap to B bits) and requantizer
(power_of_two shift with half_up / half_even / half_away ties, or ONNX float semantics).

Every integer here is a float64 holding an integer below 2^53, so the sums are exact; the
convolution is torch's own float64 conv2d.
"""
from __future__ import annotations

import numpy as np
import torch
from onnx import numpy_helper


class Graph:
    def __init__(self, model):
        self.model = model
        self.init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        self.producer = {o: n for n in model.graph.node for o in n.output}
        self.consumers = {}
        for n in model.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        for n in model.graph.node:  # Constant nodes
            if n.op_type == "Constant":
                self.init[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def attr(self, node, name, default=None):
        for a in node.attribute:
            if a.name == name:
                return {1: a.f, 2: a.i, 7: list(a.ints)}.get(a.type, default)
        return default


def group_of(model, node_name: str) -> dict:
    """The integer group rooted at the node named ``node_name``, read from the file."""
    g = Graph(model)
    node = next(n for n in model.graph.node if n.name == node_name)
    dqx, dqw = g.producer[node.input[0]], g.producer[node.input[1]]
    out = {"node": node, "x_codes_name": dqx.input[0], "s_x": float(g.init[dqx.input[1]]),
           "zp_x": int(g.init[dqx.input[2]]) if len(dqx.input) > 2 else 0,
           "w": g.init[dqw.input[0]].astype(np.float64), "s_w": g.init[dqw.input[1]].astype(np.float64).reshape(-1),
           "zp_w": g.init[dqw.input[2]].astype(np.float64) if len(dqw.input) > 2 else np.zeros(1),
           "bias": None, "relu": False, "op": node.op_type, "attrs": {a.name: g.attr(node, a.name) for a in node.attribute}}
    if len(node.input) > 2 and node.input[2]:
        out["bias"] = g.init[g.producer[node.input[2]].input[0]].astype(np.float64).reshape(-1)
    nxt = g.consumers[node.output[0]][0]
    if nxt.op_type == "Relu":
        out["relu"] = True
        nxt = g.consumers[nxt.output[0]][0]
    assert nxt.op_type == "QuantizeLinear", nxt.op_type
    out["s_y"] = float(g.init[nxt.input[1]])
    zp = g.init[nxt.input[2]]
    out["zp_y"], out["y_dtype"], out["q_out"] = int(zp), zp.dtype, nxt.output[0]
    return out


def accumulate(grp: dict, x_codes: np.ndarray) -> np.ndarray:
    """Exact sum (float64) of (x - zp_x)(w - zp_w) + bias, channels on axis 1 (Conv) / last (Gemm)."""
    x = x_codes.astype(np.float64) - grp["zp_x"]
    w = grp["w"]
    zw = grp["zp_w"].reshape(-1)
    if grp["op"] == "Conv":
        w = w - (zw.reshape(-1, 1, 1, 1) if zw.size > 1 else zw[0])
        a = grp["attrs"]
        pads = a.get("pads") or [0, 0, 0, 0]
        acc = torch.nn.functional.conv2d(
            torch.nn.functional.pad(torch.from_numpy(x), (pads[1], pads[3], pads[0], pads[2])),
            torch.from_numpy(w), stride=tuple(a.get("strides") or [1, 1]),
            dilation=tuple(a.get("dilations") or [1, 1]), groups=a.get("group") or 1).numpy()
        if grp["bias"] is not None:
            acc = acc + grp["bias"].reshape(1, -1, 1, 1)
        return acc
    w = w - zw[0] if zw.size == 1 else w - zw.reshape(-1, 1)
    if grp["op"] == "Gemm" and grp["attrs"].get("transB"):
        w = w.T
    acc = x.reshape(-1, w.shape[0]) @ w
    if grp["bias"] is not None:
        acc = acc + grp["bias"].reshape(1, -1)
    return acc.reshape(x.shape[:-1] + (w.shape[1],))


def limit(acc: np.ndarray, bits, overflow: str) -> np.ndarray:
    if bits is None:
        return acc
    half = 2.0 ** (bits - 1)
    if overflow == "saturate":
        return np.clip(acc, -half, half - 1)
    return np.mod(acc + half, 2.0 * half) - half


def requantize(grp: dict, acc: np.ndarray, kind: str, rounding: str = "half_even") -> np.ndarray:
    """Output codes for ``acc`` under the requantizer ``kind`` (power_of_two or float)."""
    info = np.iinfo(grp["y_dtype"])
    lo, hi = info.min, info.max
    if grp["relu"]:
        lo = max(lo, grp["zp_y"])
    axis = 1 if grp["op"] == "Conv" else -1
    shape = [1] * acc.ndim
    shape[axis] = -1
    if kind == "power_of_two":
        m = grp["s_x"] * grp["s_w"].reshape(shape) / grp["s_y"]
        v = acc * m  # m = 2^-n: exact in float64
        if rounding == "half_up":
            r = np.floor(v + 0.5)
        elif rounding == "half_even":
            r = np.rint(v)
        else:
            r = np.sign(v) * np.floor(np.abs(v) + 0.5)
    else:
        mult = np.float64(np.float32(grp["s_x"])) * grp["s_w"].reshape(shape)
        v = (acc * mult).astype(np.float32)
        r = np.rint(v / np.float32(grp["s_y"])).astype(np.float64)
    return np.clip(r + grp["zp_y"], lo, hi).astype(grp["y_dtype"])


def run_group(model, node_name: str, x_codes, kind: str, rounding="half_even", bits=None,
              overflow="saturate") -> tuple[np.ndarray, np.ndarray]:
    """(output codes, exact accumulators) of the group rooted at ``node_name``."""
    grp = group_of(model, node_name)
    acc = accumulate(grp, x_codes)
    return requantize(grp, limit(acc, bits, overflow), kind, rounding), acc
