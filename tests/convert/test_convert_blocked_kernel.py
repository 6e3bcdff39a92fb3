"""``dal::blocked_linear`` (dal/kernels/blocked_sums.py: int32 block sums by the C++ kernel on int8 weights,
combined in float64 in ascending block order), which dal.convert's ``BlockedWeights.value`` takes for
fewer than ``BLOCK_ROWS`` rows on the CPU: the same ``v`` as the SPEC formula and as the torch forms it
replaces (the float32 block sums, the one float64 matmul, the float64 block loop), forced side by side
on the same weights, on random and extreme codes (inputs -255 / 255, weight code differences
-128 / 127 and the INT4 extremes), odd block sizes, column counts off the kernel's 8 lanes, 1 and 8
rows; bad input codes get an error naming the element.

Oracle: tests/blocked_oracle.py (export/SPEC.md §5a in Python integers and floats, ascending order).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import blocked_oracle
from dal.convert.blocked_linear import BLOCK_ROWS, BlockedWeights
from dal.kernels import blocked_sums

needs_kernel = pytest.mark.skipif(blocked_sums.library() is None, reason="no C++ compiler: the op's generic form only")


def _weights(rng, k, n, block, lo, hi, extreme):
    codes = rng.integers(lo, hi + 1, (n, k))
    zp = np.zeros((n, k // block), np.int64)
    if extreme:  # code differences at both ends, and a column / a block full of them
        codes[:, ::2], codes[:, 1::2] = lo, hi
        codes[0, :] = lo
        codes[:, :block] = hi
    scale = rng.uniform(0.001, 0.08, (n, k // block)).astype(np.float32)
    return codes, zp, scale


def _inputs(rng, rows, k, extreme):
    xq = rng.integers(-255, 256, (rows, k))
    if extreme:
        xq[0, ::2], xq[0, 1::2] = -255, 255
        xq[-1, :] = -255
    return xq


def _forms(bw: BlockedWeights, xi: torch.Tensor, s_x: float) -> dict:
    """``v`` by each path of ``value`` (the kernel, then the torch forms with the kernel switched off)."""
    out = {"kernel": bw.value(xi, s_x)}
    w8, w32 = bw.w8, bw.w32
    try:
        bw.w8 = None
        out["float32 block sums"] = bw.value(xi, s_x) if w32 is not None else None
        bw.w32 = None
        out["float64 matmul or block loop"] = bw.value(xi, s_x)
    finally:
        bw.w8, bw.w32 = w8, w32
    return out


@needs_kernel
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("k,n,block", [(96, 19, 32), (35, 7, 5), (12, 9, 1), (64, 24, 64)])
def test_kernel_equals_the_torch_forms_and_the_spec(weights, extreme, k, n, block):
    lo, hi = (-8, 7) if weights == "int4" else (-128, 127)
    rng = np.random.default_rng([k, n, block, extreme, hi])
    codes, zp, scale = _weights(rng, k, n, block, lo, hi, extreme)
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(scale), block, 255)
    assert bw.w8 is not None and bw.s32 is not None
    s_x = float(np.float32(0.0137))
    for rows in (1, BLOCK_ROWS - 1):
        xq = _inputs(rng, rows, k, extreme)
        want = blocked_oracle.block_values(xq, 0, codes.T, zp.T, scale.T, block, s_x)
        xi = torch.tensor(xq, dtype=torch.float32)
        for name, got in _forms(bw, xi[None], s_x).items():
            if got is not None:
                np.testing.assert_array_equal(got[0].numpy(), want, err_msg=name)
    # 8 rows and more: value's float64 path; the op itself takes any number of rows
    xq = _inputs(rng, BLOCK_ROWS, k, extreme)
    want = blocked_oracle.block_values(xq, 0, codes.T, zp.T, scale.T, block, s_x)
    xi = torch.tensor(xq, dtype=torch.float32)
    np.testing.assert_array_equal(bw.value(xi, s_x).numpy(), want)
    np.testing.assert_array_equal(blocked_sums.blocked_linear(xi, bw.w8, bw.s32, block, s_x).numpy(), want)
    np.testing.assert_array_equal(blocked_sums.generic(xi, bw.w8, bw.s32, block, s_x).numpy(), want)


@needs_kernel
def test_kernel_keeps_the_ascending_order_where_no_order_is_exact():
    """Column 0: block sums +-889 B at scale 1 and 1 at scale 2^-40: only the ascending order keeps
    the 2^-40 (descending: (2^-40 - 889 B) + 889 B = 0); the other 8 columns random with spread scales.
    The torch forms take the block loop here (no order-free path)."""
    rng = np.random.default_rng(3)
    b = 32
    codes, zp, scale = _weights(rng, 3 * b, 9, b, -8, 7, False)
    codes[0, :b], codes[0, b:2 * b], codes[0, 2 * b:] = 7, -7, 0
    codes[0, 2 * b] = 1
    scale[0] = [1.0, 1.0, 2.0 ** -40]
    scale[1:, 2] *= np.float32(2.0 ** -40)
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(scale), b, 255)
    assert bw.w_exact is None and bw.w8 is not None
    xq = _inputs(rng, 3, 3 * b, False)
    xq[:, :2 * b], xq[:, 2 * b] = 127, 1
    want = blocked_oracle.block_values(xq, 0, codes.T, zp.T, scale.T, b, 0.5)
    assert (want[:, 0] == np.float32(2.0 ** -41)).all()
    for name, got in _forms(bw, torch.tensor(xq, dtype=torch.float32), 0.5).items():
        if got is not None:
            np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


def test_wide_weight_codes_keep_the_torch_forms():
    """A code difference outside int8 (an 8-bit weight with a zero point): no packed weight."""
    codes = torch.tensor([[127.0, -128.0, 5.0, 1.0]])
    bw = BlockedWeights(codes, torch.tensor([[-1, 0]], dtype=torch.int32), torch.tensor([[0.5, 0.25]]), 2, 255)
    assert bw.w8 is None  # 127 - (-1) = 128
    xq = np.array([[255, -255, 3, 4]])
    np.testing.assert_array_equal(bw.value(torch.tensor(xq, dtype=torch.float32), 0.5).numpy(),
                                  blocked_oracle.block_values(xq, 0, codes.numpy().T, np.array([[-1], [0]]),
                                                              np.array([[0.5], [0.25]], np.float32), 2, 0.5))


@pytest.mark.parametrize("form", ["kernel", "generic"])
@pytest.mark.parametrize("bad", [float("nan"), 2.5, 256.0, -256.0, float("inf")])
def test_bad_input_codes_are_refused_by_element(form, bad):
    if form == "kernel" and blocked_sums.library() is None:
        pytest.skip("no C++ compiler")
    w8 = blocked_sums.pack(torch.ones(2, 4, 3))
    s = torch.ones(2, 3)
    x = torch.zeros(2, 8)
    x[1, 5] = bad
    run = blocked_sums.blocked_linear if form == "kernel" else blocked_sums.generic
    with pytest.raises(ValueError, match=r"input element 13 \(of \(2, 8\)\)"):
        run(x, w8, s, 4, 1.0)


def test_pack_round_trips_and_refuses_wide_codes():
    w = torch.arange(-60, 60, dtype=torch.float64).reshape(2, 5, 12)  # odd block: a zero row pads it
    packed = blocked_sums.pack(w)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (2, 3, 12, 2)
    assert torch.equal(blocked_sums.unpack(packed, 5), w)
    assert blocked_sums.pack(w + 100) is None


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="do not fit block 4"):
        blocked_sums.blocked_linear(torch.zeros(1, 12), blocked_sums.pack(torch.ones(2, 4, 3)), torch.ones(2, 3),
                                    4, 1.0)


def test_op_traces_with_fake_tensors():
    """The fake implementation: shapes and dtype without running the kernel (torch.compile / export)."""
    torch.library.opcheck(torch.ops.dal.blocked_linear.default,
                          (torch.zeros(3, 8), blocked_sums.pack(torch.ones(2, 4, 5)), torch.ones(2, 5), 4, 0.5),
                          test_utils=("test_schema", "test_faketensor"))


def _onnx_codes(x: np.ndarray, s: float, lo: int, hi: int) -> np.ndarray:
    """ONNX QuantizeLinear minus the zero point, in numpy: float32 division, half-even, clamp."""
    return np.clip(np.rint(x.astype(np.float32) / np.float32(s)), lo, hi).astype(np.int64)


@needs_kernel
@pytest.mark.parametrize("rows", [1, BLOCK_ROWS - 1])
def test_input_codes_in_the_kernel_equal_quantizelinear_then_the_op(rows):
    """``BlockedWeights.input_value`` (codes made in the C++ call) on ties, values beyond the range,
    +-inf, -0: the SPEC formula on ONNX QuantizeLinear's codes, and ``value`` on them; NaN: None."""
    rng = np.random.default_rng(rows)
    k, n, block = 96, 19, 32
    codes, zp, scale = _weights(rng, k, n, block, -8, 7, False)
    bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                        torch.tensor(scale), block, 255)
    s_x, lo, hi = float(np.float32(0.0625)), -131, 124
    x = (rng.standard_normal((rows, k)) * 6).astype(np.float32)
    x[0, :8] = (np.arange(8) + 0.5) * np.float32(s_x)  # exact ties 0.5 .. 7.5 steps: half-even, not half-up
    x[0, 8:12] = [np.inf, -np.inf, -0.0, 1e30]
    x[-1, 12:16] = [(hi + 0.5) * s_x, (lo - 0.5) * s_x, 300 * s_x, -300 * s_x]
    want_codes = _onnx_codes(x, s_x, lo, hi)
    want = blocked_oracle.block_values(want_codes, 0, codes.T, zp.T, scale.T, block, s_x)
    got = bw.input_value(torch.tensor(x)[None], s_x, lo, hi)
    assert got is not None and got.shape == (1, rows, n)
    np.testing.assert_array_equal(got[0].numpy(), want)
    np.testing.assert_array_equal(bw.value(torch.tensor(want_codes, dtype=torch.float32), s_x).numpy(), want)
    cast = copy.deepcopy(bw).double()  # its float32 scales become float64: no kernel call on them
    assert cast.input_value(torch.tensor(x)[None], s_x, lo, hi) is None
    np.testing.assert_array_equal(cast.value(torch.tensor(want_codes, dtype=torch.float32), s_x).numpy(), want)
    x[-1, 5] = np.nan
    assert bw.input_value(torch.tensor(x), s_x, lo, hi) is None


@pytest.fixture(scope="module")
def blocked_model():
    """Linear -> Linear(64 -> 64, per-group INT4, read by the next Linear's int8 input quantizer: a blocked
    integer group) -> Linear(64 -> 64, per-group INT4, read by a GELU: the blocked linear with a float
    output) -> GELU -> Linear (the recipe keeps the first and the last Linear per channel)."""
    import dal

    torch.manual_seed(0)
    lin = [torch.nn.Linear(64, 64, bias=False) for _ in range(3)]
    m = torch.nn.Sequential(*lin, torch.nn.GELU(), torch.nn.Linear(64, 32, bias=False))
    qat = dal.prepare_qat(m, recipe="w4a8_int8_llm", hardware="a2000")
    g = torch.Generator().manual_seed(1)
    dal.calibrate(qat, [torch.randn(8, 64, generator=g) for _ in range(2)])
    return dal.convert(qat)


def test_integer_model_same_with_and_without_the_kernel_codes(blocked_model, monkeypatch):
    """Both blocked forms of IntegerLayer (integer group, float output) on 1 and 7 rows: the same
    numbers with the codes made in the kernel and with ``_input_codes`` + ``value``; a NaN input is
    refused naming the layer's input quantizer either way."""
    from dal.convert import ConvertError

    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :4] = torch.tensor([float("inf"), -float("inf"), 1e6, -0.0])
    with torch.no_grad():
        fused = [blocked_model(x[:1]), blocked_model(x)]
        forms = {tuple(sorted(lay.ran)) for lay in blocked_model._layers.values() if lay.blocked is not None}
        assert forms == {("integer",), ("blocked linear, float output (export/SPEC.md §5a)",)}
        monkeypatch.setattr(BlockedWeights, "input_value", lambda self, *a: None)
        plain = [blocked_model(x[:1]), blocked_model(x)]
        for a, b in zip(fused, plain):
            assert torch.equal(a, b)
        monkeypatch.undo()
        lay = next(lay for lay in blocked_model._layers.values() if lay.blocked is not None and "integer" in lay.ran)
        bad = torch.zeros(1, 64)
        bad[0, 3] = float("nan")
        with pytest.raises(ConvertError, match=rf"{lay.path}: its input holds 1 NaN"):
            lay._integer(bad, lay.plans[0])


@needs_kernel
@pytest.mark.parametrize("k,n,block", [(96, 19, 32), (35, 7, 5), (12, 17, 1), (64, 40, 64), (18, 33, 6), (28, 16, 7)])
def test_both_kernel_paths_equal_quantizelinear_then_the_spec_at_any_rows(k, n, block):
    """``dal_blocked_linear_q``'s two paths, AVX-512 VNNI (``use_vnni``, where this CPU has it: u8 codes
    shifted by ``lo`` times int8 weights, four k per lane, tiles of 8, 4 and 1 rows, 16 columns a
    vector) and AVX2 / portable, on row counts around those tiles, columns and blocks off the lanes and
    the quads, the INT4 and int8 weight extremes and inputs beyond the code range: the SPEC formula on
    ONNX QuantizeLinear's codes (numpy) for every code range, the ones wider than 255 included (the
    VNNI path does not take those)."""
    rng = np.random.default_rng([k, n, block])
    for wlo, whi in ((-8, 7), (-128, 127)):
        codes, zp, scale = _weights(rng, k, n, block, wlo, whi, True)
        bw = BlockedWeights(torch.tensor(codes, dtype=torch.float32), torch.tensor(zp, dtype=torch.int32),
                            torch.tensor(scale), block, 255)
        for rows in (1, 3, 4, 5, 8, 9, 13, 21):
            for lo, hi in ((-131, 124), (0, 255), (-255, 0), (-128, 127), (-200, 200)):
                s_x = float(np.float32(0.0625))
                x = (rng.standard_normal((rows, k)) * 6).astype(np.float32)
                x[0, ::2], x[-1, 1::2] = 1e9, -1e9  # codes at hi and lo: the widest products
                want = blocked_oracle.block_values(_onnx_codes(x, s_x, lo, hi), 0, codes.T, zp.T, scale.T, block, s_x)
                for use_vnni in (True, False):
                    got = blocked_sums.quantized_blocked_linear(torch.tensor(x), lo, hi, bw.w8, bw.s32, block, s_x,
                                                                use_vnni)
                    np.testing.assert_array_equal(got.numpy(), want, err_msg=f"rows {rows}, codes [{lo}, {hi}], "
                                                                             f"vnni {use_vnni}")


@needs_kernel
def test_quantized_op_refuses_nan_by_element_on_every_path():
    """``dal::quantized_blocked_linear`` names the first NaN's flat index, in a later tile of rows too; the
    eager entry returns None on it on both paths (the layer then makes the codes and names its quantizer)."""
    w8, s = blocked_sums.pack(torch.ones(2, 8, 5)), torch.ones(2, 5)
    x = torch.zeros(13, 16)
    x[9, 5] = float("nan")
    for use_vnni in (True, False):
        assert blocked_sums.quantized_blocked_linear(x, -128, 127, w8, s, 8, 0.5, use_vnni) is None
    with pytest.raises(ValueError, match=r"input element 149 \(of \(13, 16\)\) is NaN"):
        torch.ops.dal.quantized_blocked_linear(x, -128, 127, w8, s, 8, 0.5)


@needs_kernel
def test_quantized_op_equals_quantizelinear_then_the_spec_and_names_bad_arguments():
    """The op equals the SPEC formula (tests/blocked_oracle.py) on ONNX QuantizeLinear's codes (numpy); it
    traces with fake tensors (torch.compile); bad arguments raise a ValueError naming them rather than
    taking a second route: a weight not in pack()'s layout, a code range past 8 bits, float64 input, and a
    tensor off the CPU (its CPU implementation called directly, as a captured graph's node does)."""
    from dal.convert.host_ops import direct_calls

    rng = np.random.default_rng(5)
    codes = rng.integers(-8, 8, (11, 18))
    scale = rng.uniform(0.01, 0.1, (11, 3)).astype(np.float32)
    w8 = blocked_sums.pack(torch.tensor(codes.T.reshape(3, 6, 11), dtype=torch.float32))
    s = torch.tensor(scale.T.copy())
    x = (rng.standard_normal((9, 18)) * 3).astype(np.float32)
    want = blocked_oracle.block_values(_onnx_codes(x, 0.125, -100, 120), 0, codes.T, np.zeros((3, 11), np.int64),
                                       scale.T, 6, 0.125)
    op = torch.ops.dal.quantized_blocked_linear
    np.testing.assert_array_equal(op(torch.tensor(x), -100, 120, w8, s, 6, 0.125).numpy(), want)
    torch.library.opcheck(op.default, (torch.tensor(x), -100, 120, w8, s, 6, 0.125),
                          test_utils=("test_schema", "test_faketensor"))
    xt = torch.tensor(x)
    for args, match in (((xt, -100, 120, w8[:, :2], s, 6, 0.125), "do not fit block 6"),
                        ((xt, -300, 120, w8, s, 6, 0.125), r"code range \[-300, 120\]"),
                        ((xt.double(), -100, 120, w8, s, 6, 0.125), "must be float32")):
        with pytest.raises(ValueError, match=match):
            op(*args)
    direct = direct_calls()
    with pytest.raises(ValueError, match="handed a tensor on meta"):
        direct[op](xt.to("meta"), -100, 120, w8, s, 6, 0.125)
    with pytest.raises(ValueError, match="handed a tensor on meta"):
        direct[torch.ops.dal.blocked_linear](xt.to("meta"), w8, s, 6, 0.125)
