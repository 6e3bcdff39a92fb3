"""dal.formats.first_order against torch's once_differentiable: the same gradients, and a second
derivative through a fused kernel still raises torch's error (never a silent zero)."""
import pytest
import torch

from dal.formats import native
from dal.quantizer import FakeQuantizer

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _qat_quantizer():
    q = FakeQuantizer("uint8", symmetric=False, observer="moving_average").train()
    q(torch.randn(4, 8))
    q.end_observation("quantize")
    return q


def test_create_graph_through_a_kernel_backward_raises_on_the_second_derivative():
    q = _qat_quantizer()
    x = torch.randn(4, 8, requires_grad=True)
    y = q(x)
    assert type(y.grad_fn).__name__ == "KernelOutputFunctionBackward"
    (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_an_ordinary_backward_gives_torchs_once_differentiable_result():
    q = _qat_quantizer().set_state("frozen")  # the same scale for both calls
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 4  # some values clip
    x.requires_grad_()
    (g_plain,) = torch.autograd.grad((q(x) * 3).sum(), x)
    (g_graph,) = torch.autograd.grad((q(x) * 3).sum(), x, create_graph=True)  # torch's own wrapper
    assert torch.equal(g_plain, g_graph.detach()) and not g_plain.requires_grad
    # and both are the straight-through estimator: 3 where round(x / s) + zp is a code, else 0
    r = torch.round(x.detach() / q.scale) + q.zero_point.float()
    assert torch.equal(g_plain, 3.0 * ((r >= q.qmin) & (r <= q.qmax)).float())
    assert 0 < int((g_plain == 0).sum()) < g_plain.numel()  # the mask did clip
