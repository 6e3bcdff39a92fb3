"""FakeQuantizer per tensor on inputs that are not dense (a broadcast ``expand``, as of Deformable-DETR's
reference points, a slice with gaps, both permuted) and need no gradient: the C++ kernel runs on a
dense copy laid out as torch lays out an elementwise result (``dal.formats.memory_order.elementwise_order``);
outputs, output strides and every buffer equal the torch path's (``use_kernel(False)``, the spec) bit
for bit, in every state; a NaN is refused (the torch path decides) as on a dense input."""
import copy

import pytest
import torch

from dal.formats import native
from dal.formats.memory_order import elementwise_order
from dal.quantizer import FakeQuantizer

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


def _inputs(gen):
    """(name, non-dense tensor) pairs, each with ties (x.5 codes), zeros and saturating values."""
    def base(*shape):
        t = torch.randn(*shape, generator=gen) * 3
        flat = t.view(-1)
        flat[:4] = torch.tensor([0.0, 2.5, -1e4, 1e4])  # a zero, a tie at scale 1 (below), saturation
        return t
    yield "expand_batch", base(1, 64, 4, 2).expand(5, 64, 4, 2)
    yield "expand_inner", base(6, 1, 8).expand(6, 7, 8)
    yield "reference_points", base(1, 64, 4, 2).expand(3, 64, 4, 2)[:, :, None, :, None, :]
    yield "slice_gaps", base(6, 10)[:, ::3]
    yield "slice_transposed", base(8, 6, 5)[:, 1:5].transpose(0, 2)
    yield "expand_permuted", base(4, 1, 6).expand(4, 3, 6).permute(2, 0, 1)
    yield "one_dim_slice", base(50)[::7]


def _torch_strides(x):
    return (x / torch.tensor(1.0)).stride()


def test_elementwise_order_is_torchs_layout():
    gen = torch.Generator().manual_seed(0)
    for name, x in _inputs(gen):
        p = elementwise_order(tuple(x.shape), x.stride())
        y = torch.empty(tuple(x.shape[d] for d in p)).permute(sorted(range(x.dim()), key=p.__getitem__))
        assert y.stride() == _torch_strides(x), name


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), what
    assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), f"{what} differs"


class _Spy:
    """Records whether ``dal.formats.track.kernel_fake_quantize`` recursed onto a dense copy (the route)."""

    def __init__(self):
        from dal.formats import track
        self.track, self.real, self.calls = track, track.kernel_fake_quantize, []

    def __enter__(self):
        def spy(x, *a):
            self.calls.append(x.is_contiguous())
            return self.real(x, *a)
        self.track.kernel_fake_quantize = spy
        return self.calls

    def __exit__(self, *exc):
        self.track.kernel_fake_quantize = self.real


def _pair(fmt, symmetric, observer, gen):
    fast = FakeQuantizer(fmt, symmetric=symmetric, observer=observer).train()
    fast(torch.randn(8, 8, generator=gen))
    fast.end_observation("quantize")
    return fast, copy.deepcopy(fast).use_kernel(False)


@pytest.mark.parametrize("fmt,symmetric,observer", [("uint8", False, "moving_average"), ("int16", True, "minmax"),
                                                    ("int8", True, "minmax")])
def test_non_dense_inputs_match_the_torch_path(fmt, symmetric, observer):
    gen = torch.Generator().manual_seed(1)
    fast, slow = _pair(fmt, symmetric, observer, gen)
    for state in ("quantize", "frozen", "quantize"):
        fast.set_state(state)
        slow.set_state(state)
        for name, x in _inputs(gen):
            with _Spy() as calls:
                ya = fast(x)
            assert calls == [True], f"{state} {name}: the kernel route was not taken"
            yb = slow(x)
            _same(ya, yb, f"{state} {name} output")
            sa, sb = fast.state_dict(), slow.state_dict()
            for k in sa:
                assert torch.equal(sa[k], sb[k]), f"{state} {name} {k}"


@pytest.mark.parametrize("fmt", ["int16", "int8", "uint8"])
def test_ties_and_the_format_bounds(fmt):
    """Frozen scale s: codes k + 0.5 (ties to even), the format's bounds and one past them, +-0."""
    gen = torch.Generator().manual_seed(2)
    fast, slow = _pair(fmt, fmt != "uint8", "minmax", gen)
    fast.set_state("frozen")
    slow.set_state("frozen")
    s, zp = float(fast.scale), int(fast.zero_point)
    lo, hi = fast.qmin - zp, fast.qmax - zp
    codes = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, lo, hi, lo - 0.5, hi + 0.5, lo - 1, hi + 1, lo - 0.49, hi + 0.49])
    base = torch.cat([codes * s, torch.tensor([0.0, -0.0])])
    x = base[None, :, None].expand(3, base.numel(), 2)
    with _Spy() as calls:
        ya = fast(x)
    assert calls == [True]
    _same(ya, slow(x), f"{fmt} ties and bounds")


def test_the_kernel_takes_the_non_dense_input():
    """The route is taken: the kernel computes the output (the torch path's ops would not be called)."""
    q = FakeQuantizer("int16", symmetric=True, observer="minmax").train()
    q(torch.randn(8, 8))
    q.end_observation("quantize")
    x = torch.randn(1, 16, 2).expand(4, 16, 2)
    seen = []
    from dal.formats import track
    real = track.track_fake_quantize
    track.track_fake_quantize = lambda x, *a: seen.append(x.is_contiguous()) or real(x, *a)
    try:
        q(x)
    finally:
        track.track_fake_quantize = real
    assert seen == [True]


def test_a_nan_is_refused_as_on_a_dense_input():
    q = FakeQuantizer("int16", symmetric=True, observer="minmax").train()
    q(torch.randn(8, 8))
    q.end_observation("quantize")
    slow = copy.deepcopy(q).use_kernel(False)
    b = torch.randn(1, 16, 2)
    b[0, 3, 1] = float("nan")
    x = b.expand(4, 16, 2)
    outcomes = []
    for m in (q, slow):
        try:
            outcomes.append(("ok", m(x)))
        except Exception as e:  # noqa: BLE001 - the two paths must fail alike
            outcomes.append(("error", type(e), str(e)))
    if outcomes[0][0] == "ok":
        assert outcomes[1][0] == "ok"
        _same(outcomes[0][1], outcomes[1][1], "nan output")
    else:
        assert outcomes[0] == outcomes[1]
    for k, v in q.state_dict().items():
        assert torch.equal(v, slow.state_dict()[k]), k
