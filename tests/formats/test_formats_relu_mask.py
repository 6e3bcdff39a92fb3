"""dal.formats.relu_mask against torch's own relu_ / threshold_backward and hardtanh_ /
hardtanh_backward, bit for bit."""
import pytest
import torch
import torch.nn.functional as F

from dal.formats import native
from dal.formats.relu_mask import ReluMaskFunction, relu6_in_place, relu_in_place

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

SPECIAL = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, -1.0,
           6.0, 5.9999995, 6.0000005, -6.0]
#: the op and its torch reference
OPS = {"relu": (relu_in_place, torch.relu_), "relu6": (relu6_in_place, lambda t: F.hardtanh_(t, 0.0, 6.0))}


def _bits(t):
    return t.contiguous().view(torch.int32)


def _pair(op, x, grad):
    """(output, input gradient) by torch's op and by dal's, on copies of x."""
    out = []
    for fn in OPS[op][::-1]:
        leaf = x.clone().requires_grad_()
        y = fn(leaf * 1.0)  # a non-leaf, as a layer's output is
        y.backward(grad)
        out.append((y.detach(), leaf.grad))
    return out


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 16384 + 9, 3 * 16384])
def test_values_and_gradient_are_torchs(op, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 4
    special = [v for v in SPECIAL if v == v] if op == "relu6" and n < 64 else SPECIAL
    # (relu6: a NaN's gradient is torch's only in its vector body, which a short tensor may not reach)
    x[: min(n, len(special))] = torch.tensor(special[: min(n, len(special))])
    grad = torch.randn(n, generator=gen)
    grad[::5] = -grad[::5].abs()  # negative gradients where the input is masked: +0, not -0
    (y_ref, g_ref), (y, g) = _pair(op, x, grad)
    assert torch.equal(_bits(y), _bits(y_ref))
    assert torch.equal(_bits(g), _bits(g_ref))


def test_relu6_gives_a_nan_result_no_gradient_everywhere():
    """torch's hardtanh_backward passes a NaN's gradient in its scalar tail and not in its vector
    body; the kernel takes the body's rule at every position."""
    x = torch.tensor([float("nan"), 1.0, float("nan")]).requires_grad_()
    y = relu6_in_place(x * 1.0)
    y.backward(torch.ones(3))
    assert torch.isnan(y[0]) and torch.isnan(y[2]) and x.grad.tolist() == [0.0, 1.0, 0.0]


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


def test_where_the_kernel_does_not_apply_it_is_torchs_op():
    for x in (torch.randn(3, 4).t(), torch.randn(5, dtype=torch.float64)):  # strided; float64
        for fn, node in ((relu_in_place, "ReluBackward0"), (relu6_in_place, "HardtanhBackward0")):
            leaf = x.clone().requires_grad_()
            y = fn(leaf * 1.0)
            assert type(y.grad_fn).__name__ == node
    with torch.no_grad():
        y = relu_in_place(torch.randn(5))
        assert (y >= 0).all()
