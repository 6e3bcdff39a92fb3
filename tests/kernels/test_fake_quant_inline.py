"""The plain-torch form of dal::fake_quantize (dal.kernels.fake_quant_inline, what a FakeQuantizer
runs under torch.compile) gives the op's bits: output and straight-through gradient, on edge inputs
(ties k + 0.5, -0.0, saturation at +-1e30, NaN / inf), eagerly and compiled by inductor (its own
C++ for the division, rounding and clamp). The op itself is checked against onnx.reference in
test_kernels_fake_quantize.py; here it is the oracle for the inline form."""
import pytest
import torch

from dal.kernels import fake_quantize
from dal.kernels.fake_quant_inline import fake_quantize_inline

from kernels_common import FORMATS_Q, GRANULARITIES, assert_bits_equal, case

_CASES = [(f, g) for f in FORMATS_Q for g in GRANULARITIES if f.name in ("int8", "uint8", "fp8_e4m3")
          or g[0] == "per_tensor"]


def _both(fn, x, scale, zp, fmt, gran, t):
    x = x.clone().requires_grad_()
    y = fn(x, scale, zp, fmt, gran)
    (y * t).sum().backward()
    return y.detach(), x.grad


def _inputs(fmt, gran_case, seed):
    _, shape, gran, _, _ = gran_case
    x, s, zp = case(fmt, shape, gran, seed=seed, nonfinite=True)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[:8] = torch.tensor([-1.0, 2.0, -3.0, 4.0, -5.0, 6.0, -7.0, 8.0])  # signs on the edge values
    return torch.from_numpy(x), torch.from_numpy(s), torch.from_numpy(zp), gran, t


@pytest.mark.parametrize("fmt,gran_case", _CASES, ids=lambda v: getattr(v, "name", None) or v[0])
def test_inline_eager_equals_op(fmt, gran_case):
    x, s, zp, gran, t = _inputs(fmt, gran_case, 3)
    y1, g1 = _both(fake_quantize, x, s, zp, fmt, gran, t)
    y2, g2 = _both(fake_quantize_inline, x, s, zp, fmt, gran, t)
    assert_bits_equal(y1, y2, "y")
    assert torch.equal(g1.view(torch.int32), g2.view(torch.int32))  # -0.0 where the mask is 0 and g < 0


def test_inline_inductor_equals_op():
    """One inductor compile over several formats / granularities, channels-last input included."""
    torch._dynamo.reset()
    chosen = [c for c in _CASES if c[0].name in ("int8", "uint8", "fp8_e4m3") and
              c[1][0] in ("per_tensor", "per_channel1", "per_group_last")]
    data = [_inputs(f, g, 5) for f, g in chosen]
    x4 = torch.randn(2, 6, 5, 7).mul(4).contiguous(memory_format=torch.channels_last)
    x4[0, 0, 0, :4] = torch.tensor([0.25, -0.75, 1e30, -0.0])  # scale 0.5: ties 0.5 and -1.5

    def step(xs, x4):
        outs = [fake_quantize_inline(xi, s, zp, f, g) for xi, (_, s, zp, g, _), (f, _) in zip(xs, data, chosen)]
        outs.append(torch.relu(fake_quantize_inline(x4, torch.tensor(0.5), None, "int8")))
        return outs

    def run(fn, op):
        xs = [d[0].clone().requires_grad_() for d in data]
        x4c = x4.clone().requires_grad_()
        if op:
            outs = [fake_quantize(xi, s, zp, f, g) for xi, (_, s, zp, g, _), (f, _) in zip(xs, data, chosen)]
            outs.append(torch.relu(fake_quantize(x4c, torch.tensor(0.5), None, "int8")))
        else:
            outs = fn(xs, x4c)
        sum(((o * d[4]).sum() for o, d in zip(outs, data)), outs[-1].sum() * 0.5).backward()
        return [o.detach() for o in outs], [xi.grad for xi in xs] + [x4c.grad]

    (y1, g1), (y2, g2) = run(None, True), run(torch.compile(step, backend="inductor", fullgraph=True), False)
    for a, b in zip(y1, y2):
        assert_bits_equal(a, b, "y")
    for a, b in zip(g1, g2):
        assert torch.equal(torch.nan_to_num(a).view(torch.int32), torch.nan_to_num(b).view(torch.int32))
