"""Single-op QDQ graphs for every (op class, formats) pair a hardware model claims.

One graph per case: each input is Q -> DQ in its claimed format (an fp16 input is a Cast to
float16), each weight a constant in its format behind DQ (fp16: a float16 constant), the op
computes in float16 when any role is fp16 and in float32 otherwise, and the output is Q in its
format (integer codes are the graph output; fp8 codes are decoded exactly by DQ with scale 1;
fp16 is Cast back to float32). Opsets: 13 for int8/uint8, 19 for fp8, 21 for int16/int4
(and whatever the op needs: LayerNormalization 17, Mish 18, Gelu 20). Built from onnx only.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper, numpy_helper

T = TensorProto
# format name -> (element type, numpy dtype of its codes, opset it needs)
FORMATS = {
    "int8": (T.INT8, np.int8, 13), "uint8": (T.UINT8, np.uint8, 13),
    "int16": (T.INT16, np.int16, 21), "int4": (T.INT4, np.int8, 21),
    "fp8_e4m3": (T.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, 19),
    "fp8_e5m2": (T.FLOAT8E5M2, ml_dtypes.float8_e5m2, 19),
    "fp16": (T.FLOAT16, np.float16, 13),
}
INT_RANGE = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "int4": (-8, 7)}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# hardware activation name -> ONNX op (silu and rsqrt have none: they export as two ops)
ACTIVATION_OPS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "gelu": "Gelu", "hardswish": "HardSwish",
                  "hardsigmoid": "HardSigmoid", "elu": "Elu", "leaky_relu": "LeakyRelu",
                  "mish": "Mish", "softplus": "Softplus", "exp": "Exp"}
OP_OPSET = {"HardSwish": 14, "LayerNormalization": 17, "Mish": 18, "Gelu": 20}


def pow2(s: float) -> float:
    return float(2.0 ** np.round(np.log2(s)))


class Builder:
    """Collects nodes and initializers of one graph; ``fmt_*`` insert the format boundaries."""

    def __init__(self, compute16: bool, pow2_scales: bool, twin64: bool = False):
        self.nodes, self.inits, self.inputs, self.feeds = [], [], [], {}
        self.compute16, self.pow2, self.n = compute16, pow2_scales, 0
        self.twin64 = twin64 and compute16  # float16 values, the op in float64, rounded once
        self.opset, self.in_scale, self.w_scale = 13, None, None

    def name(self, p):
        self.n += 1
        return f"{p}{self.n}"

    def const(self, arr, dtype=None):
        nm = self.name("c")
        if dtype is None:
            self.inits.append(numpy_helper.from_array(np.asarray(arr), nm))
        else:  # int4 / float8: onnx packs or converts the values itself (int4 from ints)
            arr = np.asarray(arr)
            vals = arr.astype(np.int64 if dtype == T.INT4 else np.float32).ravel().tolist()
            self.inits.append(helper.make_tensor(nm, dtype, arr.shape, vals))
        return nm

    def node(self, op, ins, **attrs):
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        self.opset = max(self.opset, OP_OPSET.get(op, 13))
        return out

    def scale(self, s):
        return float(pow2(s) if self.pow2 else s)

    def zero_point(self, fmt):
        et, dt, ops = FORMATS[fmt]
        self.opset = max(self.opset, ops)
        zp = {"uint8": 128, "int8": 3}.get(fmt, 0)  # affine activations where the format allows
        return self.const(np.array(zp, dtype=dt)) if fmt not in FP8_MAX else self.const(np.zeros((), np.float32), et)

    def to_compute(self, v):
        return self.widen(self.node("Cast", [v], to=T.FLOAT16)) if self.compute16 else v

    def widen(self, v16):
        """In the float64 twin, a float16 value goes on in float64 (exactly)."""
        return self.node("Cast", [v16], to=T.DOUBLE) if self.twin64 else v16

    def round16(self, v):
        """The twin's op result rounded once to float16, as the float16 op's output is."""
        return self.widen(self.node("Cast", [v], to=T.FLOAT16)) if self.twin64 else v

    def activation(self, fmt, data, scale):
        """A graph input fed ``data`` (float32), in ``fmt``: Q -> DQ, or Cast to float16."""
        nm = f"in{len(self.inputs)}"  # the same names in the float64 twin
        self.inputs.append(helper.make_tensor_value_info(nm, T.FLOAT, list(data.shape)))
        self.feeds[nm] = data.astype(np.float32)
        if fmt == "fp16":
            return self.widen(self.node("Cast", [nm], to=T.FLOAT16))
        self.in_scale = np.float32(self.scale(scale)) if fmt in INT_RANGE else None
        s, zp = self.const(np.array(self.scale(scale), np.float32)), self.zero_point(fmt)
        return self.to_compute(self.node("DequantizeLinear", [self.node("QuantizeLinear", [nm, s, zp]), s, zp]))

    def weight(self, fmt, w):
        """A constant float weight ``w`` stored in ``fmt`` (symmetric, per tensor)."""
        if fmt == "fp16":
            return self.widen(self.const(w.astype(np.float16)))
        et, dt, ops = FORMATS[fmt]
        self.opset = max(self.opset, ops)
        amax = float(np.abs(w).max())
        if fmt in FP8_MAX:
            s = self.scale(amax / (FP8_MAX[fmt] / 4))
            codes = (w / s).astype(dt).astype(np.float32)
            c, zp = self.const(codes, et), self.const(np.zeros((), np.float32), et)
        else:
            lo, hi = INT_RANGE[fmt]
            s = self.scale(amax / hi)
            codes = np.clip(np.round(w / s), lo, hi)
            c = self.const(codes.astype(dt), et if fmt == "int4" else None)
            zp = self.const(np.zeros((), np.int8), et) if fmt == "int4" else self.const(np.zeros((), dt))
        self.w_scale = np.float32(s) if fmt in INT_RANGE else None
        sn = self.const(np.array(s, np.float32))
        return self.to_compute(self.node("DequantizeLinear", [c, sn, zp]))

    def bias(self, fmt, b):
        """After an integer input and weight: int32 codes at scale s_x * s_w (what exporters
        write, so the integer groups of dal.npu run); otherwise a weight in ``fmt``."""
        if self.compute16 or self.in_scale is None or self.w_scale is None:
            return self.weight(fmt, b)
        s = np.float32(self.in_scale * self.w_scale)
        codes = np.round(b / s).astype(np.int32)
        return self.node("DequantizeLinear", [self.const(codes), self.const(np.array(s, np.float32)),
                                              self.const(np.zeros((), np.int32))])

    def output(self, fmt, v, amax):
        """``v`` leaves in ``fmt``; ``amax`` is the float range it must hold."""
        if self.compute16:
            v = self.node("Cast", [v], to=T.FLOAT)
        if fmt == "fp16":
            return v, 1.0
        amax = max(float(amax), 1e-3)
        if fmt in FP8_MAX:
            s = self.scale(amax / (FP8_MAX[fmt] / 2))
        else:
            lo, hi = INT_RANGE[fmt]
            s = self.scale(2 * amax / (hi - lo))
        sn, zp = self.const(np.array(s, np.float32)), self.zero_point(fmt)
        q = self.node("QuantizeLinear", [v, sn, zp])
        if fmt in FP8_MAX:  # decode the codes exactly (scale 1): ORT returns no float8 arrays
            q = self.node("DequantizeLinear", [q, self.const(np.array(1.0, np.float32))])
        return q, s

    def model(self, out, out_fmt):
        et = FORMATS[out_fmt][0] if out_fmt in INT_RANGE else T.FLOAT
        g = helper.make_graph(self.nodes, "claim", self.inputs, [helper.make_tensor_value_info(out, et, None)],
                              self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = 10
        return m


# ------------------------------------------------------------------ one op per class
def _x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _act_in(b, fin, data):
    """Input scale covering the data (|x| <= 4 sigma), in the input's format."""
    if fin in FP8_MAX:
        return b.activation(fin, data, 4.0 / (FP8_MAX[fin] / 2))
    if fin == "fp16":
        return b.activation(fin, data, 1.0)
    lo, hi = INT_RANGE[fin]
    return b.activation(fin, data, 8.0 / (hi - lo))


def _with_bias(b, op, x, w, bias, **attrs):
    """``op(x, w, bias)``; in the float64 twin too: the bias is part of the float64 sum and the
    result is rounded once to float16 (export/SPEC.md §6, as in the Gemm case; onnx.reference's
    own float16 Conv rounds the sum before adding the bias, tests/npu/test_float_islands.py)."""
    return b.node(op, [x, w, bias], **attrs)


def _dense(b, rng, cls, fin, fw):
    if cls == "conv":
        x = _act_in(b, fin, _x(rng, 1, 4, 6, 6))
        return _with_bias(b, "Conv", x, b.weight(fw, 0.3 * _x(rng, 6, 4, 3, 3)), b.bias(fw, 0.1 * _x(rng, 6)),
                          pads=[1, 1, 1, 1])
    if cls == "conv_transpose":
        x = _act_in(b, fin, _x(rng, 1, 4, 5, 5))
        return _with_bias(b, "ConvTranspose", x, b.weight(fw, 0.3 * _x(rng, 4, 6, 3, 3)),
                          b.bias(fw, 0.1 * _x(rng, 6)), strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])
    if cls == "linear":
        x = _act_in(b, fin, _x(rng, 3, 16))
        return b.node("Gemm", [x, b.weight(fw, 0.3 * _x(rng, 5, 16)), b.bias(fw, 0.1 * _x(rng, 5))], transB=1)
    if cls == "matmul":
        return b.node("MatMul", [_act_in(b, fin, _x(rng, 2, 3, 8)), _act_in(b, fin, _x(rng, 2, 8, 4))])
    # embedding: a table in the weight format gathered by int64 indices
    idx = "indices"
    b.inputs.append(helper.make_tensor_value_info(idx, T.INT64, [2, 5]))
    b.feeds[idx] = rng.integers(0, 10, size=(2, 5)).astype(np.int64)
    return b.node("Gather", [b.weight(fw, _x(rng, 10, 6)), idx], axis=0)


POOL_ATTRS = {"MaxPool": dict(kernel_shape=[2, 2], strides=[2, 2]),
         "AveragePool": dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0),
         "GlobalAveragePool": {}}
_ACT_ATTRS = {"LeakyRelu": dict(alpha=0.1), "Elu": dict(alpha=1.0), "HardSigmoid": dict(alpha=0.2, beta=0.5)}


def _resize(b, rng, fin, variant):
    x = _act_in(b, fin, _x(rng, 1, 3, 4, 5))
    mode, _, ctm = variant.partition(":")
    scales = b.const(np.array([1, 1, 2, 2], np.float32))
    attrs = dict(mode=mode, coordinate_transformation_mode=ctm)
    if mode == "nearest":
        attrs["nearest_mode"] = "floor"  # what torch exports for F.interpolate(mode="nearest")
    return b.node("Resize", [x, "", scales], **attrs)


def _op(b, rng, cls, variant, fin, fw):
    if cls in ("conv", "conv_transpose", "linear", "matmul", "embedding"):
        return _dense(b, rng, cls, fin, fw)
    if cls in ("add", "mul", "deformable_attention"):  # §5g: the weighted sum is a quantized Mul of its operands
        a, c = _act_in(b, fin, _x(rng, 1, 4, 5, 5)), _act_in(b, fin, _x(rng, 1, 4, 5, 5))
        return b.node("Add" if cls == "add" else "Mul", [a, c])
    if cls == "cat":
        a, c = _act_in(b, fin, _x(rng, 1, 3, 4, 4)), _act_in(b, fin, _x(rng, 1, 2, 4, 4))
        return b.node("Concat", [a, c], axis=1)
    if cls == "pool":
        return b.node(variant, [_act_in(b, fin, _x(rng, 1, 4, 6, 6))], **POOL_ATTRS[variant])
    if cls == "activation":
        return b.node(variant, [_act_in(b, fin, _x(rng, 2, 4, 5))], **_ACT_ATTRS.get(variant, {}))
    if cls == "resize":
        return _resize(b, rng, fin, variant)
    if cls == "softmax":
        return b.node("Softmax", [_act_in(b, fin, _x(rng, 2, 3, 7))], axis=-1)
    if cls == "grid_sample":  # export/SPEC.md §5b: the grid DQ(int16 codes, 2^-14, 0); opset 21
        x = _act_in(b, fin, _x(rng, 1, 3, 5, 6))
        b.opset = max(b.opset, 21)
        codes = np.round(rng.uniform(-1.2, 1.2, (1, 4, 7, 2)) * 2 ** 14).astype(np.int16)
        grid = b.node("DequantizeLinear", [b.const(codes), b.const(np.array(2.0 ** -14, np.float32)),
                                           b.const(np.zeros((), np.int16))])
        return b.node("GridSample", [x, grid], mode="linear", padding_mode="zeros", align_corners=0)
    if cls == "gather":  # export/SPEC.md §5d: GatherElements on the codes (a copy), negative indices too
        x = _act_in(b, fin, _x(rng, 2, 6, 5))
        return b.node("GatherElements", [x, b.const(rng.integers(-6, 6, size=(2, 4, 5)).astype(np.int64))], axis=1)
    if cls == "scatter_add":  # §5c: DQ(d), DQ(u) on one scale -> ScatterElements(add) -> Q; opset 16
        d, u = _act_in(b, fin, _x(rng, 6, 5)), _act_in(b, fin, _x(rng, 12, 5))
        b.opset = max(b.opset, 16)
        return b.node("ScatterElements", [d, b.const(rng.integers(0, 6, size=(12, 5)).astype(np.int64)), u],
                      axis=0, reduction="add")
    assert cls == "layernorm", cls
    x = _act_in(b, fin, _x(rng, 2, 3, 8))
    dt = np.float16 if b.compute16 else np.float32
    g, be = (b.widen(b.const(v.astype(dt))) for v in (1 + 0.2 * _x(rng, 8), 0.1 * _x(rng, 8)))
    return b.node("LayerNormalization", [x, g, be], axis=-1, epsilon=1e-5)


def build(cls, variant, fin, fout, fw, pow2_scales, amax=None, twin64=False):
    """(model, feeds, output scale) of one case; ``amax=None``: the float graph (no output Q),
    run first to size the output scale. ``twin64``: the same values with each float16 op
    computed in float64 and rounded once to float16 (a correctly rounded oracle graph)."""
    compute16 = "fp16" in (fin, fout, fw)
    b = Builder(compute16, pow2_scales, twin64)
    out = b.round16(_op(b, np.random.default_rng(0), cls, variant, fin or "fp16", fw))
    if amax is None:
        if compute16:
            out = b.node("Cast", [out], to=T.FLOAT)
        return b.model(out, "fp16"), b.feeds, 1.0
    out, s = b.output(fout, out, amax)
    return b.model(out, fout), b.feeds, s
