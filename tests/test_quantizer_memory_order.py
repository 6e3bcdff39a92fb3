"""FakeQuantizer on dense non-contiguous inputs (a channels-last conv input, a transposed linear
input, a permuted deformable-attention tensor): the C++ kernel runs on the contiguous view of
their memory (``dal.formats.memory_order``); outputs, output strides, input gradients and every
buffer equal the torch path's (``use_kernel(False)``, the spec) bit for bit, in every state."""
import copy

import pytest
import torch

from dal.formats import native, per_channel
from dal.formats.memory_order import dense_order, inverse
from dal.quantizer import FakeQuantizer

from autograd_graph import graph_has

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _views(gen):
    """(name, dense non-contiguous tensor) pairs."""
    yield "channels_last", torch.randn(3, 5, 4, 6, generator=gen).contiguous(memory_format=torch.channels_last)
    yield "transposed", torch.randn(2, 7, 5, generator=gen).transpose(1, 2)
    yield "transpose_reshape", torch.randn(2, 16, 6, generator=gen).transpose(1, 2).reshape(2, 6, 4, 4)
    yield "permuted_with_ones", torch.randn(2, 1, 3, 4, 1, 2, generator=gen).permute(0, 3, 1, 5, 2, 4)


def test_dense_order_is_a_contiguous_view():
    gen = torch.Generator().manual_seed(0)
    for name, x in _views(gen):
        p = dense_order(x)
        assert p is not None, name
        y = x.permute(p)
        assert y.is_contiguous() and y.data_ptr() == x.data_ptr(), name
        assert y.permute(inverse(p)).stride() == x.stride(), name
    assert dense_order(torch.zeros(3, 4)) is None                      # contiguous already
    assert dense_order(torch.zeros(4, 6)[:, ::2]) is None              # gaps
    assert dense_order(torch.zeros(1, 4).expand(3, 4)) is None         # broadcast (overlap)
    assert dense_order(torch.zeros(4, 6)[:, :3].t()) is None           # a slice: gaps


def _layout(t):
    """The strides that place elements (a size-1 dimension's stride places none)."""
    return [s for s, n in zip(t.stride(), t.shape) if n != 1]


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype and _layout(a) == _layout(b), what
    assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), f"{what} differs"


@pytest.mark.parametrize("fmt,symmetric,observer", [("uint8", False, "moving_average"), ("int16", True, "minmax"),
                                                    ("int8", True, "minmax")])
def test_kernel_on_dense_views_matches_the_torch_path(fmt, symmetric, observer):
    gen = torch.Generator().manual_seed(1)
    fast = FakeQuantizer(fmt, symmetric=symmetric, observer=observer).train()
    fast(torch.randn(8, 8, generator=gen))
    fast.end_observation("quantize")
    slow = copy.deepcopy(fast).use_kernel(False)
    for state in ("quantize", "frozen", "quantize"):
        fast.set_state(state)
        slow.set_state(state)
        for name, x in _views(gen):
            x = x * 3
            xa, xb = (x.detach().clone(memory_format=torch.preserve_format).requires_grad_() for _ in range(2))
            assert xa.stride() == x.stride()
            ya, yb = fast(xa), slow(xb)
            assert graph_has(ya, "KernelOutput") and not graph_has(yb, "KernelOutput"), f"{state} {name}"
            _same(ya.detach(), yb.detach(), f"{state} {name} output")
            g = torch.randn(ya.shape, generator=gen)
            ya.backward(g)
            yb.backward(g)
            _same(xa.grad, xb.grad, f"{state} {name} grad")
            sa, sb = fast.state_dict(), slow.state_dict()
            for k in sa:
                assert torch.equal(sa[k], sb[k]), f"{state} {name} {k}"


def test_per_channel_keeps_the_torch_path_on_a_non_contiguous_input():
    q = FakeQuantizer("int8", symmetric=True, granularity=per_channel(1), observer="minmax").train()
    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    q(x)
    q.end_observation("quantize")
    slow = copy.deepcopy(q).use_kernel(False)
    _same(q(x), slow(x), "per channel")
