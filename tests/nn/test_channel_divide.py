"""dal.nn.channel_divide (QConvBn2d's 1/f on the conv output, one-pass backward) against torch's
own broadcast division and its autograd, bit for bit, and against float64."""
import pytest
import torch

from dal.formats import native
from dal.nn.channel_divide import channel_divide

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _same(a, b, what):
    assert a.shape == b.shape, what
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), f"{what}: NaN positions differ"
    assert torch.equal(_bits(torch.where(nan_a, 0.0, a)), _bits(torch.where(nan_b, 0.0, b))), f"{what} differs"


def _inputs(shape, gen, special=False):
    y = torch.randn(shape, generator=gen) * 3
    f = torch.rand(shape[1], generator=gen) + 0.25
    f[::3] *= -1  # negative BN gammas fold to negative f
    g = torch.randn(shape, generator=gen)
    if special:
        flat = y.view(-1)
        flat[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 3e38, -3e38])
        g.view(-1)[8:12] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-42])
    return y, f, g


SHAPES = [(8, 16, 7, 7), (1, 5, 3, 3), (4, 3, 1, 1), (2, 6, 1, 9), (3, 4, 5), (2, 64, 33, 17)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_same_bits_as_torch_division_forward_and_backward(shape, special, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(sum(shape) + 7 * special)
        y, f, g = _inputs(shape, gen, special)
        ya, fa = y.clone().requires_grad_(), f.clone().requires_grad_()
        yb, fb = y.clone().requires_grad_(), f.clone().requires_grad_()
        za = channel_divide(ya, fa)
        zb = yb / fb.reshape(1, -1, *[1] * (y.dim() - 2))
        assert za.grad_fn is not None and type(za.grad_fn).__name__.startswith("ChannelDivide")
        _same(za.detach(), zb.detach(), "output")
        za.backward(g)
        zb.backward(g)
        _same(ya.grad, yb.grad, "grad y")
        _same(fa.grad, fb.grad, "grad f")
    finally:
        torch.set_num_threads(old)


def test_against_float64():
    # One rounding each: y / f and g / f are the correctly rounded quotients (float64 division of
    # float32 values, rounded once, is exact); grad_f is a float32 sum of a float32 expression.
    gen = torch.Generator().manual_seed(3)
    y, f, g = _inputs((4, 8, 6, 5), gen)
    y, f = y.requires_grad_(), f.requires_grad_()
    z = channel_divide(y, f)
    z.backward(g)
    y64, f64, g64 = y.detach().double(), f.detach().double().reshape(1, -1, 1, 1), g.double()
    _same(z.detach(), (y64 / f64).float(), "output vs float64")
    _same(y.grad, (g64 / f64).float(), "grad y vs float64")
    exact = (-g64 * y64 / (f64 * f64)).sum((0, 2, 3)).reshape(-1)
    torch.testing.assert_close(f.grad.double(), exact, rtol=1e-5, atol=1e-5)


def test_only_one_gradient_and_fallbacks():
    gen = torch.Generator().manual_seed(4)
    y, f, g = _inputs((2, 3, 4, 4), gen)
    ya = y.clone().requires_grad_()
    channel_divide(ya, f).backward(g)  # f needs no gradient
    _same(ya.grad, g / f.reshape(1, -1, 1, 1), "grad y alone")
    fa = f.clone().requires_grad_()
    channel_divide(y, fa).backward(g)  # y needs no gradient
    fb = f.clone().requires_grad_()
    (y / fb.reshape(1, -1, 1, 1)).backward(g)
    _same(fa.grad, fb.grad, "grad f alone")
    # not the kernel's: a non-contiguous y and float64 take the plain division
    yt = y.transpose(2, 3)
    assert channel_divide(yt, f).grad_fn is None
    _same(channel_divide(yt, f), yt / f.reshape(1, -1, 1, 1), "non-contiguous")
    z = channel_divide(y.double().requires_grad_(), f.double())
    assert type(z.grad_fn).__name__ == "DivBackward0"
