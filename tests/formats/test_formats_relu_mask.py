"""dal.formats.relu_mask against torch's own relu_ / threshold_backward, bit for bit."""
import pytest
import torch

from dal.formats import native
from dal.formats.relu_mask import ReluMaskFunction, relu_in_place

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

SPECIAL = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0]


def _bits(t):
    return t.contiguous().view(torch.int32)


def _pair(x, grad):
    """(output, input gradient) by torch.relu_ and by relu_in_place, on copies of x."""
    out = []
    for relu in (torch.relu_, relu_in_place):
        leaf = x.clone().requires_grad_()
        y = relu(leaf * 1.0)  # a non-leaf, as a layer's output is
        y.backward(grad)
        out.append((y.detach(), leaf.grad))
    return out


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 16384 + 9, 3 * 16384])
def test_values_and_gradient_are_torchs(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    x[: min(n, len(SPECIAL))] = torch.tensor(SPECIAL[: min(n, len(SPECIAL))])
    grad = torch.randn(n, generator=gen)
    grad[::5] = -grad[::5].abs()  # negative gradients where the input is masked: +0, not -0
    (y_ref, g_ref), (y, g) = _pair(x, grad)
    assert torch.equal(_bits(y), _bits(y_ref))
    assert torch.equal(_bits(g), _bits(g_ref))


def test_the_node_keeps_no_result_so_the_output_may_be_written():
    """torch.relu_ saves its result: writing it before the backward fails there. The bit-mask
    node saves nothing of it: the same write goes through, with torch's gradient."""
    x = torch.randn(4, 8)
    leaf = x.clone().requires_grad_()
    y = relu_in_place(leaf * 1.0)
    assert isinstance(y.grad_fn, ReluMaskFunction._backward_cls)
    y.mul_(2.0).sum().backward()
    assert torch.equal(leaf.grad, 2.0 * (x > 0).float())
    leaf = x.clone().requires_grad_()
    y = torch.relu_(leaf * 1.0)
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_where_the_kernel_does_not_apply_it_is_torch_relu_():
    for x in (torch.randn(3, 4).t(), torch.randn(5, dtype=torch.float64)):  # strided; float64
        leaf = x.clone().requires_grad_()
        y = relu_in_place(leaf * 1.0)
        assert type(y.grad_fn).__name__ == "ReluBackward0"
    with torch.no_grad():
        y = relu_in_place(torch.randn(5))
        assert (y >= 0).all()
