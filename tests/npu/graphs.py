"""Small QDQ graphs built with onnx.helper (random int8/uint8/int4 weights, per tensor /
per channel / blocked), the way quantizers emit them."""
from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper, numpy_helper

ACT = {"u8": (np.uint8, TensorProto.UINT8, 128), "s8": (np.int8, TensorProto.INT8, 3)}
WT = {"s8": (np.int8, -127, 127), "u8": (np.uint8, 0, 255), "s4": (ml_dtypes.int4, -8, 7),
      "u4": (ml_dtypes.uint4, 0, 15)}


class Builder:
    def __init__(self, seed=0, act="u8"):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.k = [], [], 0
        self.act = act

    def name(self, p):
        self.k += 1
        return f"{p}_{self.k}"

    def init(self, arr, p="c"):
        n = self.name(p)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), n))
        return n

    def node(self, op, ins, n_out=1, **attrs):
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, ins, outs, name=self.name(op), **attrs))
        return outs[0] if n_out == 1 else outs

    def scale(self):
        return np.float32(self.rng.uniform(0.005, 0.05))

    def qdq(self, x, scale=None):
        """float -> Q -> DQ; returns (dq output, scale)."""
        dt, _, zp = ACT[self.act]
        s = self.scale() if scale is None else scale
        si, zi = self.init(np.float32(s), "s"), self.init(np.array(zp, dtype=dt), "z")
        q = self.node("QuantizeLinear", [x, si, zi])
        return self.node("DequantizeLinear", [q, si, zi]), s

    def weight(self, shape, wtype="s8", per_channel=True, axis=0, block=0):
        dt, lo, hi = WT[wtype]
        w = self.rng.integers(lo, hi + 1, size=shape).astype(dt)
        if block:
            sshape = list(shape)
            sshape[axis] = -(-shape[axis] // block)
            s = self.rng.uniform(0.001, 0.02, size=sshape).astype(np.float32)
            zp = np.zeros(sshape, dtype=dt) if wtype in ("s8", "s4") else np.full(sshape, (hi + 1) // 2, dtype=dt)
            attrs = {"axis": axis, "block_size": block}
        elif per_channel:
            s = self.rng.uniform(0.001, 0.02, size=shape[axis]).astype(np.float32)
            zp = np.zeros(shape[axis], dtype=dt) if wtype in ("s8", "s4") else np.full(shape[axis], (hi + 1) // 2, dtype=dt)
            attrs = {"axis": axis}
        else:
            s = np.float32(self.rng.uniform(0.001, 0.02))
            zp = np.array(0 if wtype in ("s8", "s4") else (hi + 1) // 2, dtype=dt)
            attrs = {}
        out = self.node("DequantizeLinear", [self.init(w, "w"), self.init(s, "ws"), self.init(zp, "wz")], **attrs)
        return out, s

    def bias(self, n, s_x, s_w):
        b = self.rng.integers(-2000, 2000, size=n).astype(np.int32)
        bs = (np.float32(s_x) * np.broadcast_to(np.asarray(s_w, np.float32), (n,))).astype(np.float32)
        return self.node("DequantizeLinear", [self.init(b, "b"), self.init(bs, "bs"), self.init(np.zeros(n, np.int32), "bz")], axis=0)

    def model(self, inputs, output, opset=21):
        out_vi = helper.make_tensor_value_info(output, TensorProto.FLOAT, None)
        g = helper.make_graph(self.nodes, "g", inputs, [out_vi], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 10
        return m


def conv_model(seed=0, act="u8", wtype="s8", per_channel=True, group=1, stride=(1, 1),
               dilation=(1, 1), pads=(1, 1, 1, 1), k=3, cin=8, cout=16, hw=12, relu=True,
               clip=False, bias=True):
    b = Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, hw])
    dx, sx = b.qdq("x")
    dw, sw = b.weight((cout, cin // group, k, k), wtype, per_channel)
    ins = [dx, dw] + ([b.bias(cout, sx, sw)] if bias else [])
    y = b.node("Conv", ins, group=group, strides=list(stride), dilations=list(dilation), pads=list(pads))
    if relu:
        y = b.node("Relu", [y])
    if clip:
        y = b.node("Clip", [y, b.init(np.float32(-0.5)), b.init(np.float32(1.0))])
    y, _ = b.qdq(y)
    return b.model([x], y)


def linear_model(seed=0, act="u8", wtype="s8", per_channel=True, op="Gemm", m=5, k=40, n=24,
                 block=0, relu=False):
    b = Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])
    dx, sx = b.qdq("x")
    if op == "Gemm":
        dw, sw = b.weight((n, k), wtype, per_channel, axis=0)
        y = b.node("Gemm", [dx, dw, b.bias(n, sx, sw)], transB=1)
    else:
        dw, sw = b.weight((k, n), wtype, per_channel, axis=1 if not block else 0, block=block)
        y = b.node("MatMul", [dx, dw])
    if relu:
        y = b.node("Relu", [y])
    y, _ = b.qdq(y)
    return b.model([x], y)


def mixed_model(seed=0, act="u8"):
    """Two conv branches, Add, Concat, MaxPool, AveragePool, Resize, GlobalAveragePool, Mul."""
    b = Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])
    dx, sx = b.qdq("x")
    dw1, sw1 = b.weight((8, 4, 3, 3))
    y1, _ = b.qdq(b.node("Relu", [b.node("Conv", [dx, dw1, b.bias(8, sx, sw1)], pads=[1, 1, 1, 1])]))
    dw2, sw2 = b.weight((8, 4, 1, 1), per_channel=False)
    y2, _ = b.qdq(b.node("Conv", [dx, dw2, b.bias(8, sx, sw2)]))
    a, _ = b.qdq(b.node("Add", [y1, y2]))
    mp, _ = b.qdq(b.node("MaxPool", [a], kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1]))
    ap, _ = b.qdq(b.node("AveragePool", [a], kernel_shape=[2, 2], strides=[2, 2]))
    c, _ = b.qdq(b.node("Concat", [mp, ap], axis=1))
    r, _ = b.qdq(b.node("Resize", [c, "", b.init(np.array([1, 1, 2, 2], np.float32))], mode="nearest"))
    m, _ = b.qdq(b.node("Mul", [r, r]))
    dw3, sw3 = b.weight((16, 16, 3, 3))
    y3, _ = b.qdq(b.node("Conv", [m, dw3], strides=[2, 2], pads=[0, 1, 1, 0]))
    g, _ = b.qdq(b.node("GlobalAveragePool", [y3]))
    f = b.node("Flatten", [g])
    dw4, sw4 = b.weight((10, 16))
    o, _ = b.qdq(b.node("Gemm", [f, dw4, b.bias(10, _sx(b), sw4)], transB=1))
    return b.model([x], o)


def _sx(b):
    return np.float32(0.02)
