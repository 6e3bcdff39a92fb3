"""dal/convert/quant_calls.py: the integer model's quantizers (IntegerQuantizer) compute ONNX
Q/DQ exactly as before, with torch-function handling (the integer model's NPUFloatOps) off:
on transposed inputs, per tensor and per channel, on float16, and on a weight Parameter, whose
output is kept across calls until the weight, the kept output or the quantizer's scale changes.

Oracle: ONNX QuantizeLinear / DequantizeLinear written here with torch's own float32 ops
(``clamp(round_half_even(x / s), lo, hi) * s``) and torch's own float16 cast, never dal's
quantizer code; the layout oracle is the plain FakeQuantizer's output strides.
"""
from __future__ import annotations

import torch
from torch import nn

from dal.convert.float_ops import NPUFloatOps
from dal.formats import per_channel
from dal.convert.probe import record
from dal.convert.quant_calls import IntegerQuantizer, dispatch_off, use_integer_quantizers
from dal.quantizer import FakeQuantizer


def frozen(fmt="int8", scale=0.05, **kw) -> FakeQuantizer:
    q = FakeQuantizer(fmt, **kw)
    if q.fmt.is_scaled:
        q(torch.linspace(-127 * scale, 127 * scale, 255))  # symmetric min-max: s = 127 * scale / 127
    q.end_observation("frozen")
    return q


def onnx_qdq(x: torch.Tensor, s: torch.Tensor, lo=-128, hi=127) -> torch.Tensor:
    """ONNX QuantizeLinear then DequantizeLinear (zero point 0) in float32."""
    return torch.clamp(torch.round(x / s), lo, hi) * s


def integer(q: FakeQuantizer) -> FakeQuantizer:
    n = use_integer_quantizers(q)
    assert n == 1 and type(q) is IntegerQuantizer
    return q


def test_transposed_input_same_values_and_strides_as_plain_quantizer():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 257, 64) * 4
    k.view(-1)[::97] = torch.tensor(0.05) * 2.5  # exact ties: round half to even
    kt = k.transpose(-2, -1)  # K^T of an attention product: dense, not contiguous
    assert not kt.is_contiguous()
    plain = frozen()
    want_strides = plain(kt).stride()
    q = integer(frozen())
    with torch.no_grad(), NPUFloatOps({}, 17):
        y = q(kt)
    assert torch.equal(y, onnx_qdq(kt, q.scale.reshape(())))
    assert y.stride() == want_strides


def test_per_channel_quantizer_on_a_transposed_input():
    xt = torch.randn(6, 8, 5).transpose(0, 1)  # per channel along axis 1 of a transposed tensor
    qc = FakeQuantizer("int8", granularity=per_channel(1))
    qc(xt)
    qc.end_observation("frozen")
    use_integer_quantizers(qc)
    with torch.no_grad(), NPUFloatOps({}, 17):
        y = qc(xt)
    assert torch.equal(y, onnx_qdq(xt, qc.scale.reshape(1, -1, 1)))


def test_weight_output_kept_until_the_weight_or_scale_changes():
    w = nn.Parameter(torch.randn(16, 8))
    q = integer(frozen())
    with torch.no_grad():
        y1 = q(w)
        assert q(w) is y1 and torch.equal(y1, onnx_qdq(w, q.scale.reshape(())))
        w.mul_(0.5)  # the weight changed in place: recomputed
        y2 = q(w)
        assert y2 is not y1 and torch.equal(y2, onnx_qdq(w, q.scale.reshape(())))
        q.scale.mul_(2.0)  # the scale changed: recomputed
        y3 = q(w)
        assert torch.equal(y3, onnx_qdq(w, q.scale.reshape(())))
        y3.add_(1.0)  # a caller wrote into the kept output: recomputed
        assert torch.equal(q(w), onnx_qdq(w, q.scale.reshape(())))


def test_fp16_quantizer_is_the_float16_cast_round_trip():
    x = torch.randn(3, 70, 5) * 1e3
    x.view(-1)[0] = 70000.0  # above float16's max: inf by the cast
    x = x.transpose(0, 2)
    q = integer(frozen("fp16"))
    with torch.no_grad(), NPUFloatOps({}, 17):
        y = q(x)
    assert torch.equal(y, x.to(torch.float16).float())


class _AddInside(nn.Module):
    def forward(self, x):
        with dispatch_off():
            return torch.sigmoid(x + 1.0)


def test_dispatch_off_is_off_under_the_probe_and_on_in_the_integer_model():
    """The probe's recorder must see a form's top-level functions (its plans read them); in the
    integer model's run the same form skips NPUFloatOps (torch's own sigmoid, not sigmoid_f64)."""
    x = torch.randn(4096)
    events, _ = record(_AddInside(), (x,), {}, [])
    assert {e.obj for e in events if e.kind == "func"} >= {torch.Tensor.add, torch.sigmoid}
    torch_own = torch.sigmoid(x + 1.0)  # no mode: torch's float32 kernel
    f64 = torch.reciprocal(1.0 + torch.exp(-(x + 1.0).double())).float()
    assert not torch.equal(torch_own, f64)  # the two differ on these inputs: the check below can fail
    with torch.no_grad(), NPUFloatOps({}, 17):
        off = _AddInside()(x)
        routed = torch.sigmoid(x + 1.0)  # under the mode: sigmoid_f64
    assert torch.equal(off, torch_own) and torch.equal(routed, f64)
