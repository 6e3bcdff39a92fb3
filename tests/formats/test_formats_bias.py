"""The int32 bias in one C++ call (dal.formats.bias) against the op-by-op torch path, bit for bit:
forward and the gradient of the bias, per tensor and per channel, ties, clipping, NaN / inf /
signed zeros; and QConv2d / QLinear, whose quantized_bias takes it."""
import pytest
import torch

from dal.formats import INT32, PER_TENSOR, Granularity, fake_quantize, native
from dal.formats.autograd import FakeQuantizeFunction
from dal.formats.qparams import code_range
from dal.formats.bias import bias_fake_quantize
from dal.nn import QConv2d, QLinear, SimpleLayerSpec, SimpleTensorSpec

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _scale(s_in, s_w):
    return (s_in.detach().float().reshape(()) * s_w.detach().float()).reshape(-1)  # QATModule.bias_scale


def _torch_path(bias, s_in, s_w):
    """What QATModule.quantized_bias computed op by op before (fake_quantize, which takes the fused
    kernel with parameters built by torch ops): bit for bit, NaN payloads included."""
    scale = _scale(s_in, s_w)
    if scale.numel() == 1:
        return fake_quantize(bias, INT32, scale.reshape(()), None, check=False)
    return fake_quantize(bias, INT32, scale, None, Granularity(axis=0), check=False)


def _eager(bias, s_in, s_w):
    """The eager FakeQuantizeFunction (torch's own ops end to end): the same values; a NaN may carry
    another payload there."""
    scale = _scale(s_in, s_w)
    gran = PER_TENSOR if scale.numel() == 1 else Granularity(axis=0)
    scale = scale.reshape(()) if scale.numel() == 1 else scale
    qmin, qmax = code_range(INT32, False)
    return FakeQuantizeFunction.apply(bias, scale, torch.zeros_like(scale), INT32, gran, qmin, qmax, 1.0)


def _same_or_both_nan(a, b):
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def _biases(n, gen):
    b = torch.randn(n, generator=gen) * 3
    special = torch.tensor([0.5, 1.5, -2.5, 3e9, -3e9, float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-30,
                            -7.25, 2.5e9, 1e38, -1e38, 4.0])
    k = min(n // 4, special.numel())
    b[:k] = special[:k]
    return b


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_bias_matches_the_torch_path(per_channel, n):
    gen = torch.Generator().manual_seed(n)
    s_in = torch.tensor([0.0123], dtype=torch.float32)
    s_w = (torch.rand(n if per_channel else 1, generator=gen) * 1e-2 + 1e-4).reshape(-1, 1, 1, 1)
    s_in_small = torch.tensor(1.0)  # scale 1: b / s is b itself, ties at .5 round to even
    for si in (s_in, s_in_small):
        sw = s_w if si is s_in else torch.ones_like(s_w)
        b1 = _biases(n, gen).requires_grad_()
        b2 = b1.detach().clone().requires_grad_()
        out1, out2 = bias_fake_quantize(b1, si, sw), _torch_path(b2, si, sw)
        assert out1 is not None
        assert torch.equal(_bits(out1), _bits(out2))
        g = torch.randn(n, generator=gen)
        g[0] = -0.0
        out1.backward(g)
        out2.backward(g)
        assert torch.equal(_bits(b1.grad), _bits(b2.grad))
        b3 = b1.detach().clone().requires_grad_()
        out3 = _eager(b3, si, sw)
        _same_or_both_nan(out1, out3)
        out3.backward(g)
        _same_or_both_nan(b1.grad, b3.grad)


def test_bias_declines_what_it_does_not_take():
    s = torch.tensor([0.5])
    assert bias_fake_quantize(torch.zeros(4, dtype=torch.float64), s, s) is None
    assert bias_fake_quantize(torch.zeros(4), s, torch.ones(3)) is None  # neither per tensor nor per channel
    assert bias_fake_quantize(torch.zeros(2, 2), s, s) is None
    assert bias_fake_quantize(torch.zeros(4), torch.ones(2), s) is None
    with torch.no_grad():
        out = bias_fake_quantize(torch.tensor([1.0, 2.0]), s, s)
    assert out.grad_fn is None and out.tolist() == [1.0, 2.0]


def _quantized(cls, *args):
    spec = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel"), input=SimpleTensorSpec("int8"))
    return cls.from_float((torch.nn.Conv2d if cls is QConv2d else torch.nn.Linear)(*args), spec, "m")


@pytest.mark.parametrize("cls,args,shape", [(QConv2d, (3, 8, 3), (2, 3, 9, 9)), (QLinear, (16, 5), (4, 16))])
@pytest.mark.parametrize("state", ["quantize", "frozen"])
def test_module_bias_is_the_torch_path(cls, args, shape, state):
    torch.manual_seed(0)
    m = _quantized(cls, *args)
    x = torch.randn(shape)
    for q in m.quantizers().values():
        q(x if q is m.input_quant else m.weight)
        q.end_observation(state)
    m.train()
    b1 = m.bias
    fast = m.quantized_bias(b1)
    ref = _torch_path(b1, m.input_quant.scale, m.weight_quant.scale)
    assert fast.grad_fn is not None and type(fast.grad_fn).__name__.startswith("KernelOutput")
    assert torch.equal(_bits(fast), _bits(ref))
    g = torch.randn_like(b1)
    (ga,) = torch.autograd.grad(fast, b1, g)
    (gb,) = torch.autograd.grad(ref, b1, g)
    assert torch.equal(_bits(ga), _bits(gb))
