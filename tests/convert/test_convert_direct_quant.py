"""dal/convert/quant_calls.py: the integer model's quantizers' direct C++ call (IntegerQuantizer
``_direct``) computes ONNX Q/DQ and the float16 cast round trip exactly, and follows every change
of the quantizer (its scale written in place, a new scale tensor, a new state, training, the kernel
switched off).

Oracle: ONNX QuantizeLinear / DequantizeLinear written here with torch's own float32 ops
(``(clamp(round_half_even(x / s) + zp, qmin, qmax) - zp) * s``), torch's float16 / float8 casts;
never dal's quantizer code.
"""
from __future__ import annotations

import torch

from dal.convert.float_ops import NPUFloatOps
from dal.convert.quant_calls import IntegerQuantizer, use_integer_quantizers
from dal.formats import fp_cast
from dal.quantizer import FakeQuantizer


def frozen(fmt="int8", lo=-6.0, hi=6.0, **kw) -> FakeQuantizer:
    q = FakeQuantizer(fmt, **kw)
    if q.fmt.is_scaled:
        q(torch.linspace(lo, hi, 255))
    q.end_observation("frozen")
    q.eval()
    assert use_integer_quantizers(q) == 1 and type(q) is IntegerQuantizer
    return q


def onnx_qdq(x, s, zp=0, qmin=-128, qmax=127):
    return (torch.clamp(torch.round(x / s) + zp, qmin, qmax) - zp) * s


def inputs() -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 67) * 4
    x.view(-1)[::7] = torch.arange(len(x.view(-1)[::7])) * 0.5 - 20  # halves: ties once scaled, and clipping
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e30, -1e30])
    return x


def run(q, x):
    with torch.no_grad(), NPUFloatOps({}, 17):
        return q(x)


def test_int8_per_tensor_symmetric_and_affine_direct_equals_onnx():
    x = inputs()
    for q in (frozen(), frozen(lo=-1.0, hi=7.0, symmetric=False), frozen("uint8", lo=0.0, hi=5.0, symmetric=False)):
        y = run(q, x)
        assert q._direct_plan[0] == "fq"  # the direct call ran
        s, zp = q.scale.reshape(()), q.zero_point.reshape(()).float()
        qmin, qmax = (0, 255) if q.fmt.name == "uint8" else (-128, 127)
        assert torch.equal(y, onnx_qdq(x, s, zp, qmin, qmax))
        assert y.shape == x.shape and y.is_contiguous()


def test_fp8_per_tensor_direct_equals_torch_float8_cast():
    x = inputs()
    q = frozen("fp8_e4m3")
    y = run(q, x)
    assert q._direct_plan[0] == "fq"
    s = q.scale.reshape(())
    want = torch.clamp(x / s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(y, want)


def test_float16_cast_direct_equals_torch_cast_and_follows_the_kernel_switch():
    x = inputs()
    x.view(-1)[4:8] = torch.tensor([65520.0, -70000.0, 2.0 ** -25, 3.0 ** -10])  # overflow, subnormal ties
    q = frozen("fp16")
    y = run(q, x)
    assert q._direct_plan[0] == "cast"
    assert torch.equal(y, x.half().float())
    previous = fp_cast.use_kernel(False)
    try:
        assert torch.equal(run(q, x), x.half().float())  # torch's two casts now, the same bits
    finally:
        fp_cast.use_kernel(previous)


def test_plan_follows_scale_state_and_training_changes():
    x = inputs()
    q = frozen()
    s0 = q.scale.clone()
    assert torch.equal(run(q, x), onnx_qdq(x, s0.reshape(())))
    q.scale.mul_(2.0)  # written in place: the new scale
    assert torch.equal(run(q, x), onnx_qdq(x, (s0 * 2).reshape(())))
    q.scale = s0 * 3  # a new tensor
    assert torch.equal(run(q, x), onnx_qdq(x, (s0 * 3).reshape(())))
    q.end_observation("off")  # a new state: the input unchanged
    assert torch.equal(run(q, x), x)
    q.end_observation("frozen")
    q.train()  # training: the whole forward (no direct plan)
    with torch.no_grad():
        q(x)
    assert q._direct_plan[0] is None
    q.eval()
    assert torch.equal(run(q, x), onnx_qdq(x, (s0 * 3).reshape(())))


def test_non_contiguous_and_grad_inputs_take_the_whole_forward():
    q = frozen()
    x = inputs().transpose(0, 2)
    y = run(q, x)
    assert torch.equal(y, onnx_qdq(x, q.scale.reshape(()))) and y.stride() == FakeQuantizer.forward(q, x).stride()
    xg = inputs().requires_grad_(True)
    y = q(xg)
    y.sum().backward()  # the straight-through gradient: the forward's autograd path ran
    assert xg.grad is not None and torch.equal(y.detach(), onnx_qdq(xg.detach(), q.scale.reshape(())))
