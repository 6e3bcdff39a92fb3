"""IntegerLayer: one Conv / Linear QAT layer as the NPU computes it.

Built from the trained QAT module (its quantizers' scales and zero points, the BN-folded and
2:4-masked weight, the bias codes), never from an ONNX file. Three forms, chosen per call by the
probe (probe.py) exactly where the NPU reference chooses between its integer group and its
float path (dal/npu/README.md, "Numeric contract"):

* **integer group** (the output goes, through at most one Relu/Clip and one max pool / nearest
  interpolate, to one per-tensor integer quantizer, or only to k >= 2 of them): input codes ``x_q = Q(x)``; ``acc = sum (x_q - zp_x)(w_q - zp_w) + b_q`` exactly
  (accumulate.py); then the hardware's requantizer (requant.py). With the float requantizer the
  layer returns ``v = float32(acc * s_x * s_w)`` (activation applied), and the consumer's own
  QuantizeLinear rounds it, which is the NPU's ``clamp(round(v / s_y) + zp_y, lo, hi)`` exactly
  (Q is monotone). With the fixed-point requantizer it computes the codes and returns their
  dequantized value ``(q - zp_y) * s_y``, which the consumer quantizes back to ``q`` exactly.
  Several readers (fan-out): with the float requantizer each quantizes ``v`` itself, which is
  its own requantizer; with the fixed-point one every reader's value is computed here and each
  reader takes its own (``fan_values``; through a max pool / interpolate: float_ops.py).
* **blocked linear with a float output** (SPEC.md §5a): a Linear with a per-group weight whose
  output is read by anything but quantizers (a float op, a graph output, its float bias Add on
  rank > 2 inputs) returns the blocked group's exact ``v`` (blocked_linear.py), then the float32
  bias, activation and output quantizer as the file's float nodes compute them.
* **float** (SPEC.md, float islands): ``float32(float64 conv/matmul of the dequantized input and
  weight)`` then the float32 bias, activation and output quantizer.

The integer conditions are the NPU's: 8/4-bit per-tensor input codes, 8/4-bit weights per
tensor or per output channel (per group of input channels: a Linear without bias, the float
requantizer, the blocked group of blocked_linear.py), a 2-D Conv weight, a Linear whose input is 2-D or
whose bias is int32 codes (torch exports a batched Linear with bias as MatMul + Add; the NPU
takes an Add of the int32 bias into the group, a float bias Add it leaves float), a per-tensor
consumer of 8/16/4-bit codes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import INT32, PER_TENSOR, per_channel, quantize
from ..nn.base import apply_activation
from ..nn.norm import QBatchNorm2d
from .blocked_linear import ACC_LIMIT, BLOCKED_FLOAT, BlockedWeights, blocked_why_not
from .accumulate import chunk_bounds, conv_exact, limit, linear_exact, refuse_int32_overflow
from .errors import ConvertError
from .fp16_region import half_dtype, half_forward
from .matmul_f64 import linear_f64
from .nan_screen import holds_nan
from .probe import GroupPlan
from .quant_calls import dispatch_off
from .requant import FixedPoint
from .wrapped import WrapsModule

_IN_CODES = {"int8", "uint8", "int4", "uint4", "int16", "uint16"}  # 16-bit: exact in float64
_W_CODES = {"int8", "uint8", "int4", "uint4"}
_OUT_CODES = {"int8", "uint8", "int16", "uint16", "int4", "uint4"}


def _active(q) -> bool:
    return q is not None and q.state in ("quantize", "frozen")


def _act_bounds(activation) -> Optional[tuple]:
    if activation is None:
        return None
    if activation == "relu":
        return (0.0, None)
    if activation == "relu6":
        return (0.0, 6.0)
    return (float(activation[1]), float(activation[2]))


def weight_and_bias(qat: nn.Module) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The float weight (BN folded, 2:4 mask applied) and bias the exporter writes."""
    if hasattr(qat, "folded_weight_and_bias"):
        w, b = qat.folded_weight_and_bias()
    else:
        w, b = qat.weight, qat.bias
    mask = getattr(qat, "weight_mask", None)
    if mask is not None:
        w = w * mask.to(w.dtype)
    return w.detach().float(), None if b is None else b.detach().float()


def fan_value(table: Optional[dict], x, q):
    """What reader quantizer ``q`` reads for ``x``: its own entry of ``table`` (IntegerLayer's
    ``fan_values``) when ``x`` is a fan-out group's output, else ``x`` itself."""
    got = table.get(id(x)) if table else None
    return got[1].get(id(q), x) if got is not None and got[0] is x else x


class IntegerLayer(WrapsModule):
    """A weighted QAT layer (``qat``) computed as the NPU does; see the module docstring. A parent
    that reads the layer's attributes (``weight``, ``stride``, ...) gets the QAT layer's (wrapped.py)."""

    #: the input scale as a float32 tensor on the input's device, made on first use (a plain
    #: attribute, not a buffer; the class default keeps its lookup off nn.Module.__getattr__)
    _s_x32 = None

    def __init__(self, qat: nn.Module, path: str, requantizer):
        super().__init__()
        self.qat, self.path, self.rq = qat, path, requantizer
        # QBatchNorm2d: the depthwise 1x1 conv it is exported as (its stride, groups, ... say so)
        self.kind = ("conv" if isinstance(qat, (nn.Conv2d, QBatchNorm2d))
                     else "linear" if isinstance(qat, nn.Linear) else "other")
        self.plans: list[GroupPlan] = []
        self.calls = 0
        self.taps = None
        self.probing = False
        self.ran: set = set()  # the forms calls took ("integer", "float", ...), for layer_forms
        w, b = weight_and_bias(qat) if self.kind != "other" else (None, None)
        self.register_buffer("w_dq", None if w is None else qat.quantized_weight(w).detach().clone())
        self.register_buffer("b_dq", None if b is None else qat.quantized_bias(b).detach().float().clone())
        self.blocked = None  # BlockedWeights of a per-group weight (blocked_linear.py)
        self.why_not = self._integer_form(w, b)
        self.fixed: dict[int, FixedPoint] = {}
        self.fan_values = None  # the model's {id(y): (y, {id(reader q): its value})}, api.py
        # what every call would otherwise look up again, fixed at convert time like the integer
        # parameters above: the FP16 / BF16 region's dtype (fp16_region.py), and whether the layer has
        # a float bias (no int32 bias codes: a batched Linear's bias Add stays float, forward())
        self.half_region = half_dtype(qat) if self.kind != "other" else None
        self.float_bias = self.kind == "linear" and self.b_dq is not None and getattr(self, "bias_q", None) is None

    # ---- convert time ---------------------------------------------------------------------
    def _integer_form(self, w, b) -> str:
        """Build the integer parameters; returns why the layer has none ("" if it has)."""
        q_in, q_w = getattr(self.qat, "input_quant", None), getattr(self.qat, "weight_quant", None)
        if self.kind == "other":
            return f"{type(self.qat).__name__} has no integer group in the NPU"
        if self.kind == "conv" and (w.ndim != 4 or getattr(self.qat, "padding_mode", "zeros") != "zeros"
                                    or isinstance(self.qat.padding, str)):
            return "not a zero-padded 2-D convolution"
        if not (_active(q_in) and q_in.fmt.name in _IN_CODES and q_in.granularity.axis is None):
            return "input is not per-tensor 16/8/4-bit integer codes"
        if not (_active(q_w) and q_w.fmt.name in _W_CODES):
            return "weight is not 8/4-bit integer codes per tensor, per channel or per group"
        s_x, zp_x = q_in.effective_qparams()
        s_w, zp_w = q_w.effective_qparams()
        self.s_x, self.zp_x, self.in_fmt = float(s_x.reshape(())), int(zp_x.reshape(())), q_in.fmt
        # the clamp of the input codes minus the zero point (_input_codes)
        self.x_lo, self.x_hi = self.in_fmt.qmin - self.zp_x, self.in_fmt.qmax - self.zp_x
        if q_w.granularity.block_size:  # export/SPEC.md §5a blocked integer group: blocked_linear.py
            return self._blocked_form(w, b, q_in, q_w, s_w, zp_w)
        codes = quantize(w, q_w.fmt, s_w.float(), zp_w, q_w.granularity, q_w.narrow_range)
        shape = [-1] + [1] * (w.ndim - 1)
        w_int = codes.float() - zp_w.float().reshape(shape if zp_w.numel() > 1 else ())
        x_max = max(self.zp_x - q_in.qmin, q_in.qmax - self.zp_x)
        self.register_buffer("w_int", w_int.contiguous())
        self.chunks = chunk_bounds(w_int if w.ndim > 2 else w_int.unsqueeze(2), int(x_max))
        if self.kind == "conv" and self.qat.groups > 1 and len(self.chunks) != 1:
            self.chunks = []
        s_w32 = s_w.float().reshape(-1)
        self.register_buffer("mult", torch.tensor(self.s_x, dtype=torch.float64) * s_w32.double())
        self.register_buffer("bias_q", None)
        self.register_buffer("bias_f", None)
        if b is not None:
            if self.qat.bias_scale() is not None:
                scale = (torch.tensor(self.s_x, dtype=torch.float32) * s_w32).float()
                gran = per_channel(0) if scale.numel() > 1 else PER_TENSOR
                bq = quantize(b, INT32, scale if scale.numel() > 1 else scale.reshape(()), None, gran)
                self.bias_q = bq.double().reshape(-1)
            else:
                self.bias_f = b.float().reshape(-1)
        if self.rq.kind != "float" and self.bias_f is not None:
            raise ConvertError(f"{self.path}: the {self.rq.kind} requantizer needs an int32 bias with scale "
                               "s_x * s_w (bias_mode='int32'), this layer has a float bias")
        return ""

    def _blocked_form(self, w, b, q_in, q_w, s_w, zp_w) -> str:
        # the blocked weights are built with a bias too: the group takes none, but the blocked
        # linear with a float output (its MatMul, then the float bias Add) is the same MatMul
        why = blocked_why_not(self.kind, False, q_in.fmt.bits, self.rq)
        if why or w.ndim != 2 or q_w.granularity.normalized_axis(2) != 1:
            return why or "per-group weight not blocked along the input channels"
        codes = quantize(w, q_w.fmt, s_w.float(), zp_w, q_w.granularity, q_w.narrow_range)
        x_max = max(self.zp_x - q_in.qmin, q_in.qmax - self.zp_x)
        self.blocked = BlockedWeights(codes, zp_w, s_w, q_w.granularity.block_size, int(x_max))
        if self.blocked.bound >= ACC_LIMIT:
            self.blocked = None
            return "per-group weight whose block sums could reach 2^29"
        return blocked_why_not(self.kind, b is not None, q_in.fmt.bits, self.rq)

    # ---- run time ---------------------------------------------------------------------------
    def forward(self, x, *rest):
        if self.probing or rest or self.kind == "other":
            return self.qat(x, *rest)
        # no op of the three forms is one NPUFloatOps replaces (float_ops.py): without its per-call dispatch
        with dispatch_off():
            return self._forward(x)

    def _forward(self, x):
        if self.fan_values:
            x = self.fan_in(x, getattr(self.qat, "input_quant", None))
        plan = self.plans[self.calls % len(self.plans)] if self.plans else GroupPlan(False)
        self.calls += 1
        # a Linear on rank > 2 inputs is MatMul + Add(bias): a group when the Add's bias is the
        # int32 codes of s_x * s_w (export/SPEC.md §4, §5a); a float bias leaves it float
        batched_float_bias = self.float_bias and x.ndim != 2
        if plan.fused and not self.why_not and not batched_float_bias:
            self.ran.add("integer")
            return self._integer(x, plan)
        # export/SPEC.md §5a blocked linear with a float output: a MatMul in the file (no bias, or a
        # bias on rank > 2 inputs: MatMul + Add; a rank-2 Linear with a bias is a Gemm, a float island)
        if self.blocked is not None and (self.b_dq is None or x.ndim > 2) and self.half_region is None:
            self.ran.add(BLOCKED_FLOAT)
            return self._blocked_float(x)
        self.ran.add("float" if not plan.fused or self.why_not else
                     "float: batched Linear with a float bias (MatMul + float Add)")
        return self._float(x)

    def _float(self, x):
        half = self.half_region
        if half is not None:  # an FP16 / BF16 region (export/SPEC.md §6), fp16_region.py
            return half_forward(self.qat, self.kind, self.w_dq, self.b_dq, x, half)
        q_in = self.qat.input_quant
        xd = q_in(x) if q_in is not None else x
        if self.kind == "conv":
            ph, pw = self.qat.padding
            xp = F.pad(xd.double(), (pw, pw, ph, ph))
            y = F.conv2d(xp, self.w_dq.double(), None, self.qat.stride, 0, self.qat.dilation, self.qat.groups)
            y = y.float()
            if self.b_dq is not None:
                y = y + self.b_dq.reshape(1, -1, 1, 1)
        else:
            y = linear_f64(self, xd, self.w_dq).float()  # dal.npu's summation order (matmul_f64.py)
            if self.b_dq is not None:
                y = y + self.b_dq
        y = apply_activation(y, self.qat.activation)
        q_out = self.qat.output_quant
        return q_out(y) if q_out is not None else y

    def _input_codes(self, x):
        """``x_q - zp_x`` (float32 integers) of the input quantizer, recorded in ``taps``."""
        if self.taps is not None:
            self.taps.setdefault(self.qat.input_quant.name, []).append(
                quantize(x, self.in_fmt, self.s_x, self.zp_x))
        # x_q - zp_x directly: clamp(round(x / s_x), qmin - zp, qmax - zp) is ONNX Q minus the
        # zero point (float32 division, half-even rounding); NaN has no code: refused
        s_x = self._s_x32
        if s_x is None or s_x.device != x.device:
            s_x = self._s_x32 = torch.tensor(self.s_x, dtype=torch.float32, device=x.device)
        xi = torch.round(x.float() / s_x)
        if not torch.compiler.is_compiling() and holds_nan(xi):  # captured: the blocked op refuses NaN
            raise ConvertError(f"{self.path}: its input holds {int(torch.isnan(xi).sum())} NaN; the NPU's "
                               f"QuantizeLinear ({self.qat.input_quant.name}) has no code for NaN")
        return xi.clamp_(self.x_lo, self.x_hi)

    def _blocked_float(self, x):
        """The blocked linear with a float output (export/SPEC.md §5a): the MatMul's value is the
        blocked group's ``v``; the float bias (one float32 Add), activation and output quantizer
        after it are the file's float nodes, as in ``_float``."""
        y = self.blocked.input_value(x, self.s_x, self.x_lo, self.x_hi) if self.taps is None else None
        if y is None:  # blocked_linear.py: the codes in the kernel call where it applies, else _input_codes
            y = self.blocked.value(self._input_codes(x), self.s_x)
        if self.b_dq is not None:
            y = y + self.b_dq
        y = apply_activation(y, self.qat.activation)
        q_out = self.qat.output_quant
        return q_out(y) if q_out is not None else y

    def _integer(self, x, plan: GroupPlan):
        if self.blocked is not None:  # export/SPEC.md §5a blocked integer group (blocked_linear.py)
            v = self.blocked.input_value(x, self.s_x, self.x_lo, self.x_hi) if self.taps is None else None
            v = self.blocked.value(self._input_codes(x), self.s_x) if v is None else v
            y = apply_activation(v, self.qat.activation)
            q_out = self.qat.output_quant
            return q_out(y) if q_out is not None else y
        xi = self._input_codes(x)
        if self.kind == "conv":
            q = self.qat
            acc = conv_exact(xi, self.w_int, self.chunks, q.stride, q.padding, q.dilation, q.groups)
            axis = 1
        else:
            acc = linear_exact(xi, self.w_int, self.chunks)
            axis = acc.ndim - 1
        shape = [1] * acc.ndim
        shape[axis] = -1
        if self.bias_q is not None:
            acc.add_(self.bias_q.reshape(shape))  # exact: integers below 2^53
        bits = self.rq.accumulator_bits
        if self.in_fmt.bits <= 8 and (bits is None or bits >= 32):  # dal.npu's exact int32 path
            refuse_int32_overflow(acc, axis, self.path, self.bias_q)  # within int32: no limit can bite
        else:
            acc = limit(acc, bits, self.rq.accumulator_overflow)
        if self.rq.kind in ("fixed_point", "power_of_two"):
            return self._fixed(acc, axis, plan)
        v = acc.mul_(self.mult.reshape(shape)).float()  # one rounding: float64 product -> float32
        if self.bias_f is not None:
            v = v + self.bias_f.reshape(shape)
        y = apply_activation(v, self.qat.activation)
        q_out = self.qat.output_quant
        return q_out(y) if q_out is not None else y

    def _fixed(self, acc, axis, plan: GroupPlan):
        """The codes of every reader (its own multiplier and shift), returned as the first
        reader's dequantized codes; with k >= 2 readers the others' are left in ``fan_values``
        (keyed by the returned tensor), which each reader takes instead (``fan_in``)."""
        q = plan.consumer
        ys = [self._fixed_one(acc, axis, plan, r) for r in plan.readers]
        if len(ys) > 1 and self.fan_values is not None:
            self.fan_values[id(ys[0])] = (ys[0], {id(r): y for r, y in zip(plan.readers, ys)})
        # Q(DQ(q)) == q: the layer's own output quantizer (if it is the consumer) changes nothing
        return q(ys[0]) if q is self.qat.output_quant else ys[0]

    def fan_in(self, x, q):
        """``x`` as reader quantizer ``q`` must see it: the dequantized codes of q's own
        requantizer when ``x`` is a fixed-point fan-out group's output, else ``x``."""
        return fan_value(self.fan_values, x, q)

    def _fixed_one(self, acc, axis, plan: GroupPlan, q):
        s_y, zp_y = q.effective_qparams()
        s_y, zp_y = float(s_y.reshape(())), int(zp_y.reshape(()))
        key = id(q)
        if key not in self.fixed:
            self.fixed[key] = FixedPoint(self.mult.cpu(), s_y, self.rq.multiplier_bits, self.rq.rounding,
                                         self.path, self.rq.kind)
        fp = self.fixed[key].to(acc.device)
        bounds = _act_bounds(self.qat.activation) or plan.act or (None, None)
        lo, hi = int(q.fmt.qmin), int(q.fmt.qmax)  # the ONNX type's range (no narrow range)
        if bounds[0] is not None:
            lo = max(lo, int(quantize(torch.tensor(bounds[0]), q.fmt, s_y, zp_y)))
        if bounds[1] is not None:
            hi = min(hi, int(quantize(torch.tensor(bounds[1]), q.fmt, s_y, zp_y)))
        codes = fp(acc, axis, zp_y, int(lo), int(hi))
        return (codes.float() - float(zp_y)) * torch.tensor(s_y, dtype=torch.float32, device=acc.device)
