"""FakeQuantizer's C++ fast path (one call per QAT step: the observer's update, the scale, the
fake quantization; dal.formats.track / fold) against its torch path, bit for bit.

The torch path (observer modules, choose_qparams, set_qparams, fake_quantize) is the spec; the
fast path is switched off with ``FakeQuantizer.use_kernel(False)`` (public: a renamed private
method cannot silently make the reference the fast path again; ``test_the_switch_takes_the_torch_path``). Every
state, the running and moving-average observers, integer / FP8 formats, per tensor and per
channel and per group, ties, zeros of both signs, non-finite batches (where the fast path must hand over),
and a quantizer called twice before one backward (a shared detection head).
"""
import copy

import pytest
import torch
from torch import nn

from dal.formats import native, per_channel, per_group
from dal.nn import QConvBn2d, SimpleLayerSpec, SimpleTensorSpec
from dal.quantizer import FakeQuantizer

from autograd_graph import graph_has

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

BUFFERS = ("scale", "zero_point", "state_code", "observer.min_val", "observer.max_val", "observer.batches_seen",
           "observer.nonfinite_count")


def _slow(q: nn.Module) -> nn.Module:
    """A copy whose every quantizer takes the torch path."""
    q = copy.deepcopy(q)
    for m in q.modules():
        if isinstance(m, FakeQuantizer):
            m.use_kernel(False)
    return q


def _same(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.is_floating_point():
        a, b = a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int64), b.contiguous().view(
            torch.int32 if b.dtype == torch.float32 else torch.int64)
    assert torch.equal(a, b), f"{what} differs"


def _same_state(fast: nn.Module, slow: nn.Module, tag: str):
    sa, sb = fast.state_dict(), slow.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        _same(sa[k], sb[k], f"{tag}: {k}")


def step_both(fast: nn.Module, slow: nn.Module, x: torch.Tensor, gen: torch.Generator, tag: str) -> None:
    """One forward and backward of ``x`` through both, with the same random gradient: outputs,
    input gradients and every buffer equal bit for bit."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = fast(xa), slow(xb)
    _same(ya.detach(), yb.detach(), f"{tag} output")
    g = torch.randn(ya.shape, generator=gen)
    ya.backward(g)
    yb.backward(g)
    _same(xa.grad, xb.grad, f"{tag} grad")
    _same_state(fast, slow, tag)


def _batches(gen):
    base = torch.randn(6, 16, generator=gen)
    yield base
    yield (base * 3).relu()                                            # zeros (+0) and a wider range
    yield torch.where(base > 0, base, torch.tensor(-0.0))              # -0.0 as the minimum
    yield torch.where(base > 0, base, torch.where(base < -1, -0.0, 0.0))  # zeros of both signs: the C++ side declines
    yield -(base * 3).relu()                                            # -0.0 as the maximum
    yield torch.round(base * 8) / 8 + 1 / 16                          # ties for power-of-two scales
    nonfinite = base.clone()
    nonfinite[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    yield nonfinite                                                   # the torch path must decide
    yield base * 1e-3


CONFIGS = [  # fmt, granularity, symmetric, narrow, observer
    ("uint8", None, False, False, "moving_average"),
    ("int8", None, True, False, "moving_average"),
    ("int8", None, True, True, "minmax"),
    ("uint4", None, True, False, "minmax"),
    ("int4", 0, True, False, "minmax"),
    ("int8", 0, True, False, "moving_average"),
    ("uint8", 0, False, False, "minmax"),
    ("fp8_e4m3", None, True, False, "minmax"),
    ("fp8_e5m2", 0, True, False, "moving_average"),
    ("int4", per_group(1, 8), True, False, "minmax"),          # an LLM weight's int4 groups (rows of 8)
    ("int8", per_group(1, 4), False, False, "moving_average"),
]


@pytest.fixture
def taken(monkeypatch):
    """How often the fast path's observer step ran (it must, or the comparisons prove nothing)."""
    import dal.quantizer as module
    count = {"track": 0}

    def counting(real, tracks=lambda args: True):
        def call(*args):
            result = real(*args)
            count["track"] += result is not None and tracks(args)
            return result
        return call
    for name in ("track_qparams", "fold_track_forward"):  # per-tensor folded weights / folded weights
        monkeypatch.setattr(module, name, counting(getattr(module, name)))
    # activations: the observer's step (its last argument) and the fake quantization in one call
    monkeypatch.setattr(module, "kernel_fake_quantize",
                        counting(module.kernel_fake_quantize, lambda args: args[-1] is not None))
    return count


@pytest.mark.parametrize("fmt,axis,symmetric,narrow,observer", CONFIGS)
def test_fast_path_matches_the_torch_path_in_every_state(fmt, axis, symmetric, narrow, observer, taken):
    gran = per_channel(axis) if isinstance(axis, int) else axis
    kw = dict(granularity=gran) if gran is not None else {}
    fast = FakeQuantizer(fmt, symmetric=symmetric, narrow_range=narrow, observer=observer, **kw).train()
    gen = torch.Generator().manual_seed(0)
    calib = torch.randn(6, 16, generator=gen)
    fast(calib)  # observe
    fast.end_observation("quantize")
    slow = _slow(fast)
    for state in ("quantize", "frozen", "quantize", "off", "quantize"):
        fast.set_state(state)
        slow.set_state(state)
        for i, x in enumerate(_batches(gen)):
            step_both(fast, slow, x, gen, f"{state} batch {i}")
    assert taken["track"] >= 3


def test_a_quantizer_called_twice_before_backward_uses_each_calls_scale():
    # A head shared across pyramid levels: the second call updates the scale in place while
    # autograd still holds the first call's fake quantization.
    fast = FakeQuantizer("uint8", symmetric=False, observer="moving_average",
                         observer_args={"averaging_constant": 0.5}).train()
    fast(torch.randn(4, 8))
    fast.end_observation("quantize")
    slow = _slow(fast)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=gen) * k for k in (1.0, 5.0)]
    grads = []
    for q in (fast, slow):
        a, b = (x.clone().requires_grad_() for x in xs)
        ((q(a) * 2).sum() + (q(b) * 3).sum()).backward()
        grads.append((a.grad, b.grad))
    for ga, gb in zip(*grads):
        _same(ga, gb, "grad")
    _same_state(fast, slow, "after two calls")


def test_conv_bn_fold_kernel_matches_the_op_by_op_step(taken):
    torch.manual_seed(0)
    spec = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel"),
                           input=SimpleTensorSpec("uint8", symmetric=False, observer="moving_average"))
    conv, bn = nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3]))
        bn.running_var.uniform_(0.5, 2.0)
    fast = QConvBn2d.from_float(conv, bn, spec, "c").train()
    for q in fast.quantizers().values():
        q.set_state("observe")
    with torch.no_grad():
        fast(torch.randn(4, 4, 8, 8))
    for q in fast.quantizers().values():
        q.end_observation("quantize")
    slow = _slow(fast)
    for step, route in enumerate(("weight", "output", "weight")):
        for m in (fast, slow):
            m._divide_output = lambda x, r=route: r == "output"
        x = torch.randn(4, 4, 8, 8)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = fast(xa), slow(xb)
        # the C++ fold against the ops
        assert graph_has(ya, "FoldedFakeQuantize") and not graph_has(yb, "FoldedFakeQuantize")
        _same(ya.detach(), yb.detach(), f"step {step} output")
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        _same(xa.grad, xb.grad, f"step {step} grad x")
        _same(fast.weight.grad, slow.weight.grad, f"step {step} grad W")
        # d/d gamma: BN's own term plus the fold's sum, which the kernel accumulates in double
        torch.testing.assert_close(fast.bn.weight.grad, slow.bn.weight.grad, rtol=1e-5, atol=1e-6)
        _same_state(fast, slow, f"step {step}")
        for m in (fast, slow):
            m.weight.grad = m.bn.weight.grad = m.bn.bias.grad = None
    assert taken["track"] >= 6


def test_the_switch_takes_the_torch_path(taken):
    q = FakeQuantizer("int8", observer="moving_average").train()
    q(torch.randn(4, 8))
    q.end_observation("quantize")
    slow = _slow(q)
    y = slow(torch.randn(4, 8).requires_grad_())
    assert taken["track"] == 0 and not graph_has(y, "KernelOutput")
    w = torch.randn(8, 3, 3, 3)
    assert slow.fold_quantize(w, torch.rand(8) + 0.5, False) is None
    y = q(torch.randn(4, 8).requires_grad_())  # the original keeps its fast path
    assert taken["track"] == 1 and graph_has(y, "KernelOutput")
    slow.use_kernel(True)
    assert graph_has(slow(torch.randn(4, 8).requires_grad_()), "KernelOutput")
