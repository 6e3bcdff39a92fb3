"""Is a one-LSB difference between a float engine and the NPU reference a near-tie? Tested code by code.

A float engine (the torch QAT model, onnxruntime with optimizations off) and the integer NPU
reference compute the same quantized layer from the same quantized inputs (layer by layer). Both
round a value before the output ``QuantizeLinear``; the float engine's value carries float32
rounding errors, the NPU's its requantizer's. They can land on different codes only if a rounding
boundary ``k + 0.5`` (in code units) lies between them, so only if the exact value ``v`` lies
within the sum of the two engines' error bounds of that boundary::

    code difference of 1 is a near-tie  <=>  min_k |v - (k + 0.5)| <= E_float + E_npu

For a float8 output (zero point 0) codes differ by one step of the format's grid (codes.ordinals)
and the boundary between the two codes is the midpoint of their values, ``(a + b) / 2``, in the
same units ``x / s_y`` (layer_verdict.judge_codes).

Everything here is computed in float64 from the integer codes both engines were given
(``(q - zp) * s`` is exact in float64: a <= 17-bit integer times a float32 scale):

``v``      the layer's value before rounding, in codes: ``x / s_y + zp_y`` with ``x`` evaluated
           from the codes in float64 through the ops between the input ``DequantizeLinear`` nodes
           and the output ``QuantizeLinear``.
``E_float`` the float32 error bound, propagated op by op as an absolute bound ``e`` per element
           (``u = 2^-24``, ``gamma_n = n u / (1 - n u)``, Higham's standard bounds):

           * DequantizeLinear: ``e = u |v|`` (one float32 product; integer or float8 codes, a float8
             code's value exact in float64);
           * Conv / Gemm / MatMul with fan-in ``n`` (bias included as one more term):
             ``e = |x| * e_w + e_x * (|w| + e_w) + e_b + gamma_{n+2} * ((|x| + e_x) * (|w| + e_w) + |b| + e_b)``,
             ``*`` the op itself: the float32 summation bound ``|fl(sum) - sum| <= gamma_n sum |x_i w_i|``,
             any summation order, with the inputs' own errors carried through;
           * Add / Sub: ``e_a + e_b + u (|a| + |b| + e_a + e_b)``; Mul: ``|a| e_b + |b| e_a + e_a e_b + u |ab|'``;
           * AveragePool / GlobalAveragePool / ReduceMean (``n`` terms): ``mean(e) + gamma_{n+1} mean(|x| + e)``;
           * Relu, Clip, MaxPool, Max / Min (1-Lipschitz, exact in float): ``e`` carried (MaxPool: the
             window's largest ``e``); Flatten, Reshape, Transpose, (Un)Squeeze, Identity, Concat, Split,
             Slice, Expand, Gather: moved with the values (shape operands read from the engines' integers);
           * Sigmoid, Tanh, HardSigmoid, HardSwish, Erf: ``L e + 8 u |f(x)|`` (``L`` the function's Lipschitz
             constant: 1/4, 1, alpha, 3/2, 2/sqrt(pi); 8 ulp for a vectorised float32 implementation);
             Div ``(e_a + |a/b| e_b) / (|b| - e_b) + u |a/b|``; Sqrt ``min(sqrt(e), e / (sqrt(x - e) + sqrt(x))) + u sqrt(x)``;
             Pow 2 ``2 |x| e + e^2 + u (|x| + e)^2``; Exp ``exp(x) expm1(e) + 8 u exp(x + e)``;
             Softmax over ``n``: ``1.01 y expm1(2 max e + 10 u + u |x - max x| + gamma_{n+1})``;
             GridSample: near_tie_smooth.grid_sample_bound (the coordinate's error times the slope);
             ReduceSum over ``n`` terms: ``sum(e) + gamma_n sum(|x| + e)``;
             LayerNormalization: near_tie_smooth.layer_norm_bound (inputs' errors through ``d / sigma``,
             the mean's, variance's, sqrt's and division's rounding, then ``* scale + bias``);
             InstanceNormalization the same over the spatial axes (near_tie_smooth.instance_norm_bound);
           * Cast to float16 / float32: ``e + 2^-11 |v|`` / ``e + u |v|``;

           then the output quantizer's float32 division: ``E_float = e / s_y + 2 u |v - zp_y|``.
``E_npu``  the NPU reference's own rounding of the same value (its requantization multiply): a
           float requantizer rounds ``acc * s_x s_w`` to float32 and divides in float32,
           ``2 u |v - zp_y|``; a fixed-point one multiplies by ``m 2^-n`` instead of
           ``s_x s_w / s_y``, ``|m 2^-n / (s_x s_w / s_y) - 1| |v - zp_y|`` per channel; power of
           two: 0. Where the NPU runs the node in float32 as onnxruntime does, ``E_float`` covers it.

A float64 error term ``gamma64_{n+2}`` times the same magnitude is added so the float64
evaluation itself cannot tip a verdict. An op outside the list above has no bound: a differing
code behind it is not shown to be a near-tie, and counts as a failure, naming the op.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper

from .codes import is_float8

U = 2.0 ** -24   # float32 unit roundoff
U64 = 2.0 ** -53  # float64 unit roundoff
U16 = 2.0 ** -11  # float16 unit roundoff

LIPSCHITZ = {"Sigmoid": 0.25, "Tanh": 1.0, "HardSwish": 1.5}
SHAPE_OPS = {"Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Concat", "Split", "Slice",
             "Expand", "Gather"}


def gamma(n: int, u: float = U) -> float:
    """``gamma_n = n u / (1 - n u)``: the relative bound of an ``n``-term float sum (Higham, 3.1)."""
    nu = n * u
    if nu >= 1:
        return float("inf")
    return nu / (1.0 - nu)


def distance_to_tie(v) -> np.ndarray:
    """``min_k |v - (k + 0.5)|``: how far a value in code units is from the nearest rounding boundary."""
    v = np.asarray(v, dtype=np.float64)
    return np.abs(v - (np.floor(v) + 0.5))


def is_near_tie(v, bound) -> np.ndarray:
    """True where a value ``v`` (code units, before rounding) lies within ``bound`` of a boundary ``k + 0.5``."""
    return distance_to_tie(v) <= np.asarray(bound, dtype=np.float64)


class NoBound(Exception):
    """The layer holds an op without an error model here (the message names it)."""


@dataclass
class Exact:
    """A tensor of the layer in float64: ``v`` the exact value, ``e`` the float32 engines' error
    bound, ``mag`` the float64 evaluation's magnitude (for its own tiny error bound)."""

    v: torch.Tensor
    e: torch.Tensor
    mag: torch.Tensor


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float64)))


def _axis_shape(p: np.ndarray, rank: int, axis: int) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if p.size == 1:
        return p.reshape(())
    shape = [1] * rank
    shape[axis % rank] = p.size
    return p.reshape(shape)


class LayerEvaluator:
    """Evaluates the value before rounding of any ``QuantizeLinear`` of ``model`` from integer codes.

    ``codes`` maps tensor names to the integer codes the engines were given (layer by layer:
    onnxruntime's, or the NPU's); ``feed`` the graph inputs. ``requantizer`` is the file's
    ``dal.requantizer`` metadata (a dict with ``kind``, and ``multiplier_bits`` when fixed point).
    """

    def __init__(self, model: onnx.ModelProto, codes: dict, feed: dict, requantizer: Optional[dict] = None):
        from .onnx_tools import constants, producers

        self.model = model
        self.consts = constants(model)
        self.made_by = producers(model)
        self.codes = codes
        self.feed = feed
        self.requantizer = requantizer or {"kind": "float"}
        self._memo: dict = {}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)

    # -- the value before rounding, and its bound ---------------------------------------------------
    def pre_rounding(self, q_node) -> tuple[np.ndarray, np.ndarray]:
        """(``v``, ``E_float + E_npu``) in code units for every element of ``q_node``'s output
        (module docstring). Raises NoBound naming the op without an error model."""
        x = self._eval(q_node.input[0])
        scale = self.consts.get(q_node.input[1])
        zp = self.consts.get(q_node.input[2]) if len(q_node.input) > 2 and q_node.input[2] else np.zeros(())
        if scale is None or zp is None:
            raise NoBound(f"{q_node.name}: its scale or zero point is not a constant")
        axis = attr(q_node, "axis", 1)
        rank = x.v.dim()
        s, z = _axis_shape(scale, rank, axis), _axis_shape(zp, rank, axis)
        codes = x.v.numpy() / s
        e_float = x.e.numpy() / s + 2 * U * np.abs(codes)
        e64 = gamma(64, U64) * x.mag.numpy() / s + 2 * U64 * np.abs(codes)
        return codes + z, e_float + self._npu_rounding(q_node, np.abs(codes), rank) + e64

    def _npu_rounding(self, q_node, abs_codes: np.ndarray, rank: int) -> np.ndarray:
        kind = self.requantizer.get("kind", "float")
        if kind == "float":
            return 2 * U * abs_codes
        group = self._group_scales(q_node)
        if group is None:  # not an integer group: the NPU runs it in float32, inside E_float
            return 2 * U * abs_codes
        x_scale, w_scale, y_scale = group
        if kind == "power_of_two":
            return np.zeros_like(abs_codes)
        from ..npu.metadata import fixed_point_params  # verification may read dal.npu (tests/test_layers.py)

        bits = int(self.requantizer.get("multiplier_bits", 31))
        rel = []
        for ws in np.asarray(w_scale, dtype=np.float64).reshape(-1):
            mult = float(np.float64(x_scale) * ws / np.float64(y_scale))
            m, n = fixed_point_params(mult, bits)
            rel.append(abs(m * 2.0 ** -n / mult - 1.0))
        rel_a = np.asarray(rel)
        channel_last = self._group_op(q_node) != "Conv"  # Gemm / MatMul: output channels last
        shape = [1] * (rank - 1) + [-1] if channel_last else [1, -1] + [1] * (rank - 2)
        rel_t = rel_a.reshape(()) if rel_a.size == 1 else rel_a.reshape(shape)
        return (rel_t + 2 * U) * abs_codes

    def _group_op(self, q_node) -> str:
        node = self.made_by.get(q_node.input[0])
        while node is not None and node.op_type in ("Relu", "Clip"):
            node = self.made_by.get(node.input[0])
        return node.op_type if node is not None else ""

    def _group_scales(self, q_node):
        """(s_x, s_w, s_y) when ``q_node`` ends a DQ -> Conv/Gemm/MatMul [-> Relu/Clip] -> Q group."""
        node = self.made_by.get(q_node.input[0])
        while node is not None and node.op_type in ("Relu", "Clip"):
            node = self.made_by.get(node.input[0])
        if node is None or node.op_type not in ("Conv", "Gemm", "MatMul"):
            return None
        dqs = [self.made_by.get(i) for i in node.input[:2]]
        if any(d is None or d.op_type != "DequantizeLinear" for d in dqs):
            return None
        xs, ws, ys = (self.consts.get(dqs[0].input[1]), self.consts.get(dqs[1].input[1]),
                      self.consts.get(q_node.input[1]))
        if xs is None or ws is None or ys is None or xs.size != 1 or ys.size != 1:
            return None
        return float(xs.reshape(())), ws, float(ys.reshape(()))

    # -- float64 evaluation with error propagation ------------------------------------------------
    def _eval(self, name: str) -> Exact:
        if name in self._memo:
            return self._memo[name]
        node = self.made_by.get(name)
        if node is None or name in self.consts:  # a Constant node's output is a constant, not an op
            if name in self.consts:
                v = _t(self.consts[name])
                out = Exact(v, torch.zeros_like(v), v.abs())
            elif name in self.feed:
                v = _t(self.feed[name])
                out = Exact(v, torch.zeros_like(v), v.abs())
            else:
                raise NoBound(f"tensor {name!r}: neither a node output, a constant nor a graph input")
        else:
            out = self._node(node, name)
        self._memo[name] = out
        return out

    def _integer(self, name: str) -> np.ndarray:
        if name in self.consts:
            return self.consts[name]
        if name in self.codes:
            return np.asarray(self.codes[name])
        if name in self.feed:  # codes that are a graph input (a decode graph's past_* KV cache)
            return np.asarray(self.feed[name])
        raise NoBound(f"no codes for {name!r} (the layer's integer input)")

    def _node(self, node, name: str) -> Exact:
        op = node.op_type
        if op == "DequantizeLinear":
            q = self._integer(node.input[0])
            if q.dtype.kind not in "iu" and not is_float8(q):  # float8 codes: their values, exact in float64
                raise NoBound(f"{node.name}: DequantizeLinear of {q.dtype} (not integer or float8 codes)")
            rank, axis = q.ndim, attr(node, "axis", 1)
            s = _axis_shape(self.consts[node.input[1]], rank, axis)
            z = _axis_shape(self.consts[node.input[2]], rank, axis) if len(node.input) > 2 and node.input[2] else 0
            v = _t((q.astype(np.float64) - z) * s)
            return Exact(v, U * v.abs(), v.abs())
        if op in ("Conv", "Gemm", "MatMul"):
            return self._linear(node)
        if op in ("Shape", "Size", "ConstantOfShape"):  # integers known exactly: no rounding error
            v = _t(self._int_value(name))
            return Exact(v, torch.zeros_like(v), v.abs())
        if op in SHAPE_OPS:  # only the data operand is a value; the others are shapes, axes, indices
            return self._shape(node, [self._eval(node.input[0])] + [None] * (len(node.input) - 1), name)
        ins = [self._eval(i) if i else None for i in node.input]
        a = ins[0]
        if op in ("Add", "Sub"):
            b = ins[1]
            v = a.v + b.v if op == "Add" else a.v - b.v
            mag = a.mag + b.mag
            return Exact(v, a.e + b.e + U * (a.v.abs() + b.v.abs() + a.e + b.e), mag)
        if op == "Mul":
            b = ins[1]
            v = a.v * b.v
            e = a.v.abs() * b.e + b.v.abs() * a.e + a.e * b.e + U * (a.v.abs() + a.e) * (b.v.abs() + b.e)
            return Exact(v, e, a.mag * b.mag)
        if op == "Relu":
            return Exact(a.v.clamp_min(0), a.e, a.mag)
        if op == "Clip":
            lo = ins[1].v if len(ins) > 1 and ins[1] is not None else attr(node, "min", None)
            hi = ins[2].v if len(ins) > 2 and ins[2] is not None else attr(node, "max", None)
            v = a.v
            v = torch.maximum(v, torch.as_tensor(lo, dtype=torch.float64)) if lo is not None else v
            v = torch.minimum(v, torch.as_tensor(hi, dtype=torch.float64)) if hi is not None else v
            return Exact(v, a.e, a.mag)
        if op in ("Max", "Min"):
            b = ins[1]
            v = torch.maximum(a.v, b.v) if op == "Max" else torch.minimum(a.v, b.v)
            return Exact(v, torch.maximum(a.e, b.e), torch.maximum(a.mag, b.mag))
        if op == "MaxPool":
            return self._pool(node, a, "max")
        if op in ("AveragePool", "GlobalAveragePool", "ReduceMean"):
            return self._pool(node, a, "mean")
        if op in LIPSCHITZ or op == "HardSigmoid":
            f = {"Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "HardSwish": F.hardswish}.get(op)
            if op == "HardSigmoid":
                alpha, beta = attr(node, "alpha", 0.2), attr(node, "beta", 0.5)
                v, lip = (alpha * a.v + beta).clamp(0, 1), abs(alpha)
            else:
                v, lip = f(a.v), LIPSCHITZ[op]
            return Exact(v, lip * a.e + 8 * U * v.abs(), torch.maximum(v.abs(), a.mag))
        if op in ("Div", "Erf", "Sqrt", "Pow", "Exp", "Softmax"):
            from .near_tie_smooth import smooth_bound

            return smooth_bound(node, op, ins)
        if op == "ReduceSum":  # near_tie_smooth.reduce_sum_bound states the bound
            from .near_tie_smooth import reduce_sum_bound

            axes = self._int_value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
            return reduce_sum_bound(node, a, axes)
        if op in ("LayerNormalization", "InstanceNormalization", "GridSample"):  # near_tie_smooth states each bound
            from . import near_tie_smooth as smooth

            bound = {"LayerNormalization": smooth.layer_norm_bound, "InstanceNormalization": smooth.instance_norm_bound,
                     "GridSample": smooth.grid_sample_bound}[op]
            return bound(node, *ins[:3]) if op != "LayerNormalization" or len(ins) > 2 else bound(node, a, ins[1], None)
        if op == "Cast":
            to = attr(node, "to", 0)
            if to == onnx.TensorProto.FLOAT16:
                return Exact(a.v, a.e + U16 * (a.v.abs() + a.e), a.mag)
            if to == onnx.TensorProto.FLOAT:
                return Exact(a.v, a.e + U * (a.v.abs() + a.e), a.mag)
        raise NoBound(f"{node.name} ({op}): no float32 error model for this op")

    def _linear(self, node) -> Exact:
        op = node.op_type
        x, w = self._eval(node.input[0]), self._eval(node.input[1])
        b = self._eval(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if op == "Conv":
            if attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
                raise NoBound(f"{node.name} (Conv): auto_pad is not modelled")
            nd = x.v.dim() - 2
            conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(nd)
            if conv is None:
                raise NoBound(f"{node.name} (Conv): {nd}-D convolution is not modelled")
            pads = list(attr(node, "pads", [0] * (2 * nd)))
            if pads[:nd] != pads[nd:]:
                raise NoBound(f"{node.name} (Conv): asymmetric pads are not modelled")
            kw = dict(stride=tuple(attr(node, "strides", [1] * nd)), padding=tuple(pads[:nd]),
                      dilation=tuple(attr(node, "dilations", [1] * nd)), groups=attr(node, "group", 1))
            fn = lambda a, c: conv(a, c, None, **kw)  # noqa: E731
            n = int(np.prod(w.v.shape[1:]))
            bshape = [1, -1] + [1] * nd
        else:
            ta, tb = (attr(node, "transA", 0), attr(node, "transB", 0)) if op == "Gemm" else (0, 0)
            alpha = attr(node, "alpha", 1.0) if op == "Gemm" else 1.0
            if op == "Gemm" and (alpha != 1.0 or attr(node, "beta", 1.0) != 1.0):
                raise NoBound(f"{node.name} (Gemm): alpha / beta other than 1 are not modelled")
            fa = (lambda t: t.transpose(-1, -2)) if ta else (lambda t: t)
            fb = (lambda t: t.transpose(-1, -2)) if tb else (lambda t: t)
            fn = lambda a, c: torch.matmul(fa(a), fb(c))  # noqa: E731
            n = int(fa(x.v).shape[-1])
            bshape = None
        v = fn(x.v, w.v)
        e = fn(x.v.abs(), w.e) + fn(x.e, w.v.abs() + w.e)
        mag = fn(x.v.abs() + x.e, w.v.abs() + w.e)
        if b is not None:
            bv, be = (b.v.reshape(bshape), b.e.reshape(bshape)) if bshape else (b.v, b.e)
            v, e, mag = v + bv, e + be, mag + bv.abs() + be
        return Exact(v, e + gamma(n + 2) * mag, mag)

    def _pool(self, node, a: Exact, how: str) -> Exact:
        op = node.op_type
        nd = a.v.dim() - 2
        if op == "GlobalAveragePool" or (op == "ReduceMean" and self._global_axes(node, a)):
            dims = tuple(range(2, a.v.dim())) if op == "GlobalAveragePool" else self._global_axes(node, a)
            keep = True if op == "GlobalAveragePool" else bool(attr(node, "keepdims", 1))
            n = int(np.prod([a.v.shape[d] for d in dims]))
            mean = lambda t: t.mean(dim=dims, keepdim=keep)  # noqa: E731
            return Exact(mean(a.v), mean(a.e) + gamma(n + 1) * mean(a.v.abs() + a.e), mean(a.mag))
        if nd != 2 or attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise NoBound(f"{node.name} ({op}): only 2-D pooling with explicit pads is modelled")
        k = tuple(attr(node, "kernel_shape", None))
        pads = list(attr(node, "pads", [0] * 4))
        if pads[:2] != pads[2:]:
            raise NoBound(f"{node.name} ({op}): asymmetric pads are not modelled")
        kw = dict(kernel_size=k, stride=tuple(attr(node, "strides", [1, 1])), padding=tuple(pads[:2]),
                  ceil_mode=bool(attr(node, "ceil_mode", 0)))
        if how == "max":
            if tuple(attr(node, "dilations", [1, 1])) != (1, 1):
                raise NoBound(f"{node.name} (MaxPool): dilations are not modelled")
            return Exact(F.max_pool2d(a.v, **kw), F.max_pool2d(a.e, **kw), F.max_pool2d(a.mag, **kw))
        kw["count_include_pad"] = bool(attr(node, "count_include_pad", 0))
        n = int(np.prod(k))
        e = F.avg_pool2d(a.e, **kw) + gamma(n + 1) * F.avg_pool2d(a.v.abs() + a.e, **kw)
        return Exact(F.avg_pool2d(a.v, **kw), e, F.avg_pool2d(a.mag, **kw))

    def _int_value(self, name: str) -> np.ndarray:
        """A shape / axes / index operand: a constant, the engines' own integers, or computed here from
        Shape and the integer ops after it (onnx.reference), the shape being the evaluated tensor's."""
        if name in self.consts:
            return self.consts[name]
        if name in self.codes:
            return np.asarray(self.codes[name])
        node = self.made_by.get(name)
        if node is None:
            raise NoBound(f"tensor {name!r}: an operand with no value")
        if node.op_type == "Shape":
            shape = np.array(self._eval(node.input[0]).v.shape, dtype=np.int64)
            start, end = attr(node, "start", 0), attr(node, "end", None)
            return shape[start:end]
        args = [self._int_value(i) if i else None for i in node.input]
        if any(a is not None and a.dtype.kind == "f" for a in args):
            raise NoBound(f"{node.name} ({node.op_type}): a float operand where a shape was expected")
        return _run_one(node, args, self.opset, list(node.output).index(name), keep_type=True)

    def _global_axes(self, node, a: Exact):
        axes = attr(node, "axes", None)
        if axes is None and len(node.input) > 1 and node.input[1] in self.consts:
            axes = self.consts[node.input[1]].reshape(-1).tolist()
        if axes is None:
            raise NoBound(f"{node.name} (ReduceMean): no axes")
        return tuple(sorted(int(d) % a.v.dim() for d in axes))

    def _shape(self, node, ins, name: str) -> Exact:
        """Apply a data-movement op to the value, its bound and its magnitude alike (onnx.reference);
        every input of a Concat is data, of the others only the first (the rest: integer operands)."""
        data_inputs = len(node.input) if node.op_type == "Concat" else 1
        values = [(ins[k] if ins[k] is not None else self._eval(n)) if n else None
                  for k, n in enumerate(node.input[:data_inputs])]
        operands = [self._int_value(n).astype(np.int64) if n else None for n in node.input[data_inputs:]]
        index = list(node.output).index(name)
        outs = []
        for field_ in ("v", "e", "mag"):
            args = [getattr(x, field_).numpy() if x is not None else None for x in values] + operands
            outs.append(_t(_run_one(node, args, self.opset, index)))
        return Exact(*outs)


def _run_one(node, args, opset: int, index: int = 0, keep_type: bool = False) -> np.ndarray:
    """Output ``index`` of one ONNX node on float64 numpy inputs, with onnx.reference (an
    implementation dal did not write); an empty optional input stays empty."""
    from onnx.reference import ReferenceEvaluator

    inputs = [f"i{k}" if a is not None else "" for k, a in enumerate(args)]
    outs = [f"o{k}" for k in range(len(node.output))]
    n = helper.make_node(node.op_type, inputs, outs, **{a.name: helper.get_attribute_value(a) for a in node.attribute})
    vis = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), None)
           for name, a in zip(inputs, args) if name]
    graph = helper.make_graph([n], "one", vis, [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
                                                for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feed = {name: a for name, a in zip(inputs, args) if name}
    out = np.asarray(ReferenceEvaluator(model).run(None, feed)[index])
    return out if keep_type else out.astype(np.float64)


def attr(node, name: str, default):
    """An ONNX node attribute's value, or ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
