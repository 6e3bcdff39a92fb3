"""Property tests (hypothesis): random shapes, scales, zero points and adversarial values against
onnxruntime and onnx.reference, on dal's fused and eager paths."""
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dal.formats as F
from dal.formats.autograd import FakeQuantizeFunction
from formats_common import FP8_FORMATS, INT_FORMATS, assert_same_floats
from formats_oracle import run

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
pow2_scale = st.integers(-20, 20).map(lambda k: float(2.0 ** k))
any_scale = st.floats(2.0 ** -20, 1000.0, width=32)


@st.composite
def case(draw, fmts):
    fmt = draw(st.sampled_from(fmts))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank)))
    kind = draw(st.sampled_from(["tensor", "channel", "group"]))
    axis = draw(st.integers(0, rank - 1))
    block = 0
    if kind == "group":
        block = draw(st.sampled_from([b for b in (1, 2, 3, 4, 5) if shape[axis] % b == 0]))
        gran = F.per_group(axis, block)
    elif kind == "channel":
        gran = F.per_channel(axis)
    else:
        gran, axis = F.PER_TENSOR, None
    sshape = gran.scale_shape(shape)
    n_s = int(np.prod(sshape, dtype=np.int64))
    scale = np.array(draw(st.lists(st.one_of(pow2_scale, any_scale), min_size=n_s, max_size=n_s)),
                     np.float32).reshape(sshape)
    if fmt.is_integer:
        zp = np.array(draw(st.lists(st.integers(int(fmt.qmin), int(fmt.qmax)), min_size=n_s, max_size=n_s)),
                      np.int64).reshape(sshape)
    else:
        zp = np.zeros(sshape, np.int64)
    n = int(np.prod(shape))
    # Values: raw floats (subnormals, huge), exact ties k + 0.5 times the scale, codes near the edges.
    ties = st.integers(-40000, 40000).map(lambda k: k + 0.5)
    v = np.array(draw(st.lists(st.one_of(f32, ties, st.integers(-70000, 70000).map(float)), min_size=n, max_size=n)),
                 np.float64).reshape(shape)
    s_full = gran.expand(torch.from_numpy(scale), shape).expand(shape).numpy().astype(np.float64)
    use_scaled = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape)
    x = np.where(use_scaled, v * s_full, v)
    # onnx.reference wraps for |x / scale| >= 2^31 (it casts rint(x/s) to int32 before clipping): keep inside for it
    x = np.clip(x, -(2.0 ** 30) * s_full, 2.0 ** 30 * s_full).astype(np.float32)
    return fmt, gran, axis, block, x, scale, zp


def _check(fmt, gran, axis, block, x, scale, zp):
    xt, st_, zt = torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zp)
    q = F.quantize(xt, fmt, st_, zt, gran)
    for oracle in ("ort", "ref"):
        codes, deq = run(oracle, fmt, x, scale, zp, axis, block)
        if fmt.is_float8:
            assert_same_floats(q.float(), codes, oracle)
        else:
            np.testing.assert_array_equal(q.to(torch.int32).numpy(), codes, err_msg=oracle)
        assert_same_floats(F.fake_quantize(xt, fmt, st_, zt, gran), deq, oracle)
    qmin, qmax = F.code_range(fmt)
    assert_same_floats(FakeQuantizeFunction.apply(xt, st_, zt.float(), fmt, gran, qmin, qmax, 1.0), deq, "eager")


@SETTINGS
@given(case(INT_FORMATS))
def test_integer_formats_match_onnx(c):
    _check(*c)


@SETTINGS
@given(case(FP8_FORMATS))
def test_fp8_formats_match_onnx(c):
    _check(*c)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(INT_FORMATS), pow2_scale, st.integers(-300, 300))
def test_exact_ties_round_half_even(fmt, scale, k):
    """x / scale = k + 0.5 exactly (power-of-two scale): the code is the even neighbour."""
    x = torch.tensor([(k + 0.5) * scale], dtype=torch.float32)
    even = k if k % 2 == 0 else k + 1
    expected = min(max(even, fmt.qmin), fmt.qmax)
    assert int(F.quantize(x, fmt, scale)) == expected
