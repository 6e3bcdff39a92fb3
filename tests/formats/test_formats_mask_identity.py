"""The fused backward where nothing was clipped returns the incoming gradient itself
(dal.formats.fused): the same bits as the eager straight-through gradient ``g * mask``
(torch's own ops), for the kernel's Function and the one-call QAT path, with the row layouts'
partial mask bytes."""
import pytest
import torch

from dal.formats import PER_TENSOR, native, per_channel
from dal.formats.autograd import FakeQuantizeFunction
from dal.formats.fused import FusedFakeQuantizeFunction
from dal.formats.qformat import INT8
from dal.quantizer import FakeQuantizer

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _grad(fn, x, g):
    x = x.clone().requires_grad_()
    fn(x).backward(g)
    return x.grad


@pytest.mark.parametrize("shape,gran", [((5, 13), PER_TENSOR), ((3, 7, 5), per_channel(1)), ((64, 9), per_channel(0))])
@pytest.mark.parametrize("clipped", [False, True])
def test_backward_is_the_eager_gradient(shape, gran, clipped):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.rand(shape, generator=gen) * 2 - 1
    if clipped:
        x.view(-1)[-1] = 9.0  # one element past the range, in the last (partial) mask byte
    ch = 1 if gran is PER_TENSOR else shape[gran.axis]
    scale = torch.full((ch,) if ch > 1 else (), 1 / 127)
    zp = torch.zeros_like(scale, dtype=torch.int32)
    g = torch.randn(shape, generator=gen)
    g.view(-1)[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-42])
    fused = _grad(lambda t: FusedFakeQuantizeFunction.apply(t, scale, zp, INT8, gran, -128, 127), x, g)
    eager = _grad(lambda t: FakeQuantizeFunction.apply(t, scale, zp, INT8, gran, -128, 127, 1.0), x, g)
    nan = torch.isnan(eager)
    assert torch.equal(nan, torch.isnan(fused))
    assert torch.equal(_bits(fused)[~nan], _bits(eager)[~nan])
    if not clipped:
        assert torch.equal(_bits(fused), _bits(g))  # g itself, the NaN's payload included


def test_qat_step_without_clipping_passes_the_gradient_through():
    q = FakeQuantizer("int8", observer="moving_average")
    q(torch.linspace(-2, 2, 64))
    q.end_observation("quantize")
    q.train()
    x = torch.linspace(-1, 1, 64).requires_grad_()
    g = torch.randn(64)
    y = q(x)
    assert type(y.grad_fn).__name__.startswith("KernelOutput")
    y.backward(g)
    assert torch.equal(_bits(x.grad), _bits(g))
    x2 = (torch.linspace(-1, 1, 64) * 40).requires_grad_()  # clipped at both ends
    q(x2).backward(g)
    r = torch.round(x2.detach() / q.scale)  # this step's scale: the eager mask
    inside = ((r >= -128) & (r <= 127)).float()
    assert 0 < inside.sum() < 64
    assert torch.equal(_bits(x2.grad), _bits(g * inside))
