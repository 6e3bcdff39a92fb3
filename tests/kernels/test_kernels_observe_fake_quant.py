"""dal::observe_fake_quantize_ (a min-max quantizer's QAT step in one op): its C++ CPU step, its CPU
composite and its device-generic implementation give the same bits, and they are the formulas
written here in numpy: the observer's update (running min / max, float32 moving average), the
scale in float64 rounded once to float32, ONNX QuantizeLinear -> DequantizeLinear in float32
(divide, round half to even, saturate) and the STE mask; torch's own fake_quantize_per_tensor_affine
where it is ONNX's (power-of-two scales). torch.library.opcheck on the op."""
import numpy as np
import pytest
import torch

from dal.formats import FORMATS, native
from dal.formats.qparams import code_range
from dal.kernels import fake_quant as FQ
from dal.kernels import observe_fake_quant as OFQ

from kernels_common import assert_bits_equal

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"C++ kernel unavailable: {native.status()}")


def _oracle(x, mn, mx, c, fmt, symmetric, axis):
    """numpy: (y, mask, min, max, scale, zero_point) after one observer step on x (float32 arrays;
    axis None per tensor, 0 per row)."""
    x = np.asarray(x, np.float32)
    red = None if axis is None else tuple(range(1, x.ndim))
    lo, hi = x.min(axis=red), x.max(axis=red)
    if c == 0.0:
        mn, mx = np.minimum(mn, lo), np.maximum(mx, hi)
    else:
        c = np.float32(c)
        mn = np.where(np.isfinite(mn), (mn + c * (lo - mn)).astype(np.float32), lo).astype(np.float32)
        mx = np.where(np.isfinite(mx), (mx + c * (hi - mx)).astype(np.float32), hi).astype(np.float32)
    qmin, qmax = code_range(fmt, False)
    lo64, hi64 = np.minimum(mn, 0).astype(np.float64), np.maximum(mx, 0).astype(np.float64)
    if symmetric:
        zp = np.zeros_like(lo64) + (0 if fmt.signed else (qmin + qmax + 1) // 2)
        s = np.maximum(-lo64, hi64) / (qmax - zp)
    else:
        s = (hi64 - lo64) / (qmax - qmin)
        zp = np.clip(qmin - np.rint(lo64 / np.where(s > 0, s, 1.0)), qmin, qmax)
    s = np.maximum(np.where(s > 0, s, 1.0), 2.0 ** -100).astype(np.float32)
    shape = (-1,) + (1,) * (x.ndim - 1) if axis is not None else ()
    sb, zb = s.reshape(shape), zp.astype(np.float32).reshape(shape)
    r = np.rint(x / sb)  # float32 division: IEEE, as ONNX; then saturate(r + zp) - zp, -0.0 kept
    lo_c, hi_c = (np.float32(qmin) - zb).astype(np.float32), (np.float32(qmax) - zb).astype(np.float32)
    mask = (r >= lo_c) & (r <= hi_c)
    y = (np.minimum(np.maximum(r, lo_c), hi_c) * sb).astype(np.float32)
    return y, mask, mn, mx, s, zp.astype(np.int32)


def _buffers(mn, mx):
    mn, mx = torch.tensor(mn, dtype=torch.float32), torch.tensor(mx, dtype=torch.float32)
    return [mn, mx, torch.tensor(3), torch.tensor(0), torch.ones_like(mn), torch.zeros(mn.shape, dtype=torch.int32)]


PATHS = ["cpp", "cpu_composite", "generic"]


def _run(path, x, bufs, c, fmt, symmetric, axis, power_of_two=None):
    args = (x, *bufs, c, fmt.name, symmetric, False, power_of_two, axis, 0, True)
    if path == "cpp":
        done = OFQ.cpu_step(x, *bufs[:3], *bufs[4:], c, fmt.name, symmetric, False, power_of_two, axis, 0, True)
        assert done is not None, "the C++ step was expected to apply"
        return done
    return OFQ.composite(*args, cpu=path == "cpu_composite")


def _cases():
    rng = np.random.default_rng(7)
    s0 = 2.0 ** -4
    ties = ((rng.integers(-140, 140, (4, 3, 8, 8)) + 0.5) * s0).astype(np.float32)  # exact ties of 2^-4
    ties.reshape(-1)[:4] = [127 * s0, -127 * s0, 0.0, -0.0]
    wide = (rng.normal(0, 3, (4, 3, 8, 8))).astype(np.float32)
    return {"ties": ties, "wide": wide}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,symmetric", [(FORMATS["int8"], True), (FORMATS["uint8"], False),
                                           (FORMATS["uint8"], True), (FORMATS["int4"], True)],
                         ids=["int8sym", "uint8aff", "uint8sym", "int4sym"])
@pytest.mark.parametrize("c", [0.0, 0.25], ids=["minmax", "ema"])
@pytest.mark.parametrize("axis", [None, 0], ids=["per_tensor", "per_row"])
def test_paths_equal_numpy(path, fmt, symmetric, c, axis):
    """Two steps on inputs with exact ties (scale 2^-4 when the running range is +-127 * 2^-4) and on
    wide inputs that a moving average's lagging range clips (saturation): output, mask, range,
    scale, zero point and batches_seen as numpy's, on each path."""
    for name, x in _cases().items():
        n = 1 if axis is None else x.shape[0]
        mn, mx = np.full(n, -127 * 2.0 ** -4, np.float32), np.full(n, 127 * 2.0 ** -4, np.float32)
        if axis is None:
            mn, mx = mn[0], mx[0]
        bufs = _buffers(mn, mx)
        for step in range(2):
            xs = x * np.float32(1 + step)
            y, m = _run(path, torch.from_numpy(xs), bufs, c, fmt, symmetric, axis)
            ey, emask, mn, mx, es, ez = _oracle(xs, mn, mx, c, fmt, symmetric, axis)
            tag = f"{path} {name} step {step}"
            assert_bits_equal(y, ey, tag)
            rows, row_len = FQ.mask_layout(xs.shape, axis, 0)
            assert np.array_equal(FQ.unpack_mask(m, rows, row_len, xs.shape).numpy(), emask), tag
            assert_bits_equal(bufs[0], mn, tag)
            assert_bits_equal(bufs[1], mx, tag)
            assert_bits_equal(bufs[4], es, tag)
            assert np.array_equal(bufs[5].numpy(), ez) and int(bufs[2]) == 4 + step, tag
            if name == "wide" and c and step:
                assert not emask.all()  # the moving average clipped: saturation is exercised


def test_ties_are_torchs_fake_quantize():
    """With a power-of-two scale torch's own fake_quantize_per_tensor_affine (x * (1/s)) is ONNX's:
    the op's output equals it, ties included."""
    x = torch.from_numpy(_cases()["ties"]).clamp(-127 * 2.0 ** -4, 127 * 2.0 ** -4)  # the range stays: s = 2^-4
    for path in PATHS:
        bufs = _buffers(np.float32(-127 * 2.0 ** -4), np.float32(127 * 2.0 ** -4))
        y, _ = _run(path, x, bufs, 0.0, FORMATS["int8"], True, None)
        assert float(bufs[4]) == 2.0 ** -4
        # equal values (torch's op returns +0.0 for a -0.0 input, dal keeps the sign: dal::fake_quantize)
        assert torch.equal(y, torch.fake_quantize_per_tensor_affine(x, 2.0 ** -4, 0, -128, 127)), path


@pytest.mark.parametrize("case", ["nan", "signed_zero_extreme", "minmax_zero", "pow2", "channels_last"])
def test_declined_and_other_layouts_equal_generic(case):
    """Where the C++ step declines (NaN, a zero extreme with zeros of both signs, a running
    min / max touching zero), power-of-two scales and a channels-last input: the CPU op (whatever
    route it takes) equals the device-generic implementation: output, mask, all six buffers."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.normal(0, 1, (2, 4, 5, 5)).astype(np.float32))
    mn, mx, c, pow2 = -2.0, 2.0, 0.0, None
    if case == "nan":
        x.view(-1)[[3, 9]] = torch.tensor([float("nan"), float("inf")])
    elif case == "signed_zero_extreme":
        x = torch.relu(x)
        x.view(-1)[:2] = torch.tensor([0.0, -0.0])
        mn, c = float("inf"), 0.1  # first EMA step: the zero's sign is the range's
        mx = float("-inf")
    elif case == "minmax_zero":
        x = torch.relu(x)
        mn = 0.0
    elif case == "pow2":
        pow2 = "cover"
    else:
        x = x.contiguous(memory_format=torch.channels_last)
    if case in ("nan", "signed_zero_extreme", "minmax_zero"):
        b = _buffers(np.float32(mn), np.float32(mx))
        assert OFQ.cpu_step(x, *b[:3], *b[4:], c, "uint8", False, False, pow2, None, 0, True) is None
    outs = []
    for cpu in (True, False):
        bufs = _buffers(np.float32(mn), np.float32(mx))
        if cpu:
            y, m = OFQ.observe_fake_quantize_(x, *bufs, c, "uint8", False, False, pow2, None, 0, True)
        else:
            y, m = OFQ.composite(x, *bufs, c, "uint8", False, False, pow2, None, 0, True, cpu=False)
        outs.append((y, m, bufs))
    (y1, m1, b1), (y2, m2, b2) = outs
    assert_bits_equal(y1, y2, case)
    assert y1.stride() == y2.stride() == x.stride() and torch.equal(m1, m2)
    for a, b in zip(b1, b2):
        assert a.dtype == b.dtype and torch.equal(a, b), case
    assert int(b1[3]) == (2 if case == "nan" else 0)


def test_gradient_is_the_clip_mask():
    """d y / d x = the mask (STE) through observe_fake_quantize, per tensor and per row, channels-last
    included; the gradient of a clipped value is 0 * g (signed zero)."""
    rng = np.random.default_rng(5)
    for axis, fmt in ((None, "uint8"), (0, "int8")):
        for cl in (False, True):
            x = torch.from_numpy(rng.normal(0, 3, (4, 3, 6, 6)).astype(np.float32))
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            n = () if axis is None else (4,)
            bufs = _buffers(np.full(n, -1.0, np.float32), np.full(n, 1.0, np.float32))
            ref = [b.clone() for b in bufs]
            y = OFQ.observe_fake_quantize(x, *bufs, 0.5, fmt, fmt == "int8", False, None, axis, 0)
            g = torch.from_numpy(rng.normal(0, 1, x.shape).astype(np.float32))
            y.backward(g)
            _, m = OFQ.composite(x.detach(), *ref, 0.5, fmt, fmt == "int8", False, None, axis, 0, True, cpu=False)
            perm = FQ.mask_perm(x, axis, 0) or (0, 1, 2, 3)  # the mask is in x's memory order
            mask = FQ.unpack_mask(m, *FQ.mask_layout(x.shape, axis, 0), x.permute(perm).shape)
            mask = mask.permute(sorted(range(4), key=perm.__getitem__))
            assert not mask.all() and mask.any()
            assert_bits_equal(x.grad, g * mask, f"axis {axis} channels_last {cl}")


def test_opcheck():
    x = torch.randn(4, 3, 5, 5)
    for axis in (None, 0):
        n = () if axis is None else (4,)
        for c in (0.0, 0.1):
            for need in (True, False):
                bufs = [torch.full(n, -1.0), torch.full(n, 1.0), torch.tensor(2), torch.tensor(0), torch.ones(n),
                        torch.zeros(n, dtype=torch.int32)]
                torch.library.opcheck(torch.ops.dal.observe_fake_quantize_.default,
                                      (x * 2, *bufs, c, "uint8", False, False, None, axis, 0, need))


@pytest.mark.parametrize("axis,block", [(1, 5), (1, 0)], ids=["per_group", "per_channel_axis1"])
def test_groups_and_inner_channels_equal_generic(axis, block):
    """Per group (blocks of 5 along the last axis, an LLM weight's int4 groups: the C++ step, one row
    per group) and per channel on an inner axis (no C++ step: the three ops' CPU forms): the CPU op
    equals the device-generic one and numpy's running min / max of each block."""
    rng = np.random.default_rng(9)
    x = torch.from_numpy(rng.normal(0, 2, (6, 10)).astype(np.float32))
    n = 6 * 10 // block if block else 10
    shape = (6, 2) if block else (10,)
    outs = []
    for cpu in (True, False):
        bufs = [torch.full(shape, -0.5), torch.full(shape, 0.5), torch.tensor(1), torch.tensor(0), torch.ones(shape),
                torch.zeros(shape, dtype=torch.int32)]
        args = (x, *bufs, 0.0, "int4", True, False, None, axis, block, True)
        if cpu:  # the C++ step applies per group, not per inner channel
            applies = OFQ.cpu_step(x, *[b.clone() for b in bufs[:3]], *[b.clone() for b in bufs[4:]], 0.0, "int4",
                                   True, False, None, axis, block, True) is not None
            assert applies == bool(block)
        y, m = OFQ.observe_fake_quantize_(*args) if cpu else OFQ.composite(*args, cpu=False)
        outs.append((y, m, bufs))
    (y1, m1, b1), (y2, m2, b2) = outs
    assert_bits_equal(y1, y2)
    assert torch.equal(m1, m2) and all(torch.equal(a, b) for a, b in zip(b1, b2))
    blocks = x.numpy().reshape(6, 2, 5) if block else x.numpy().T
    red = 2 if block else 1
    assert b1[0].numel() == n
    np.testing.assert_array_equal(b1[0].numpy().reshape(-1), np.minimum(blocks.min(axis=red), -0.5).reshape(-1))
    np.testing.assert_array_equal(b1[1].numpy().reshape(-1), np.maximum(blocks.max(axis=red), 0.5).reshape(-1))


@pytest.mark.parametrize("fmt,symmetric", [(FORMATS["int4"], True), (FORMATS["int8"], False)], ids=["int4sym", "int8aff"])
@pytest.mark.parametrize("c", [0.0, 0.25], ids=["minmax", "ema"])
def test_per_group_cpp_step_equals_numpy(fmt, symmetric, c):
    """Per group of 32 along the last axis (an LLM weight's int4 groups): the C++ step (one row per
    group) equals numpy's formulas on the groups as rows, two steps, ties and saturation included,
    and the mask follows the input's order."""
    for name, x in _cases().items():
        x = x.reshape(24, 32)  # 768 values: 24 groups of 32, as a (12, 64) weight with groups of 32
        mn, mx = np.full(24, -127 * 2.0 ** -4, np.float32), np.full(24, 127 * 2.0 ** -4, np.float32)
        bufs = _buffers(mn.reshape(12, 2), mx.reshape(12, 2))
        for step in range(2):
            xs = x * np.float32(1 + step)
            xw = torch.from_numpy(xs.reshape(12, 64).copy())
            done = OFQ.cpu_step(xw, *bufs[:3], *bufs[4:], c, fmt.name, symmetric, False, None, 1, 32, True)
            assert done is not None, "the C++ step was expected to apply"
            y, m = done
            ey, emask, mn, mx, es, ez = _oracle(xs, mn, mx, c, fmt, symmetric, 0)
            tag = f"{name} step {step}"
            assert_bits_equal(y, ey.reshape(12, 64), tag)
            rows, row_len = FQ.mask_layout((12, 64), 1, 32)
            assert np.array_equal(FQ.unpack_mask(m, rows, row_len, (12, 64)).numpy(), emask.reshape(12, 64)), tag
            assert_bits_equal(bufs[0], mn.reshape(12, 2), tag)
            assert_bits_equal(bufs[1], mx.reshape(12, 2), tag)
            assert_bits_equal(bufs[4], es.reshape(12, 2), tag)
            assert np.array_equal(bufs[5].numpy(), ez.reshape(12, 2)) and int(bufs[2]) == 4 + step, tag
