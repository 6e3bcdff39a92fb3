"""The blocked linear's C++ kernel (dal/npu/blocked_kernel.py, csrc/blocked_gemm.cpp) against the
numpy path it replaces (``BlockedStep.value_numpy``) and the SPEC formula (tests/blocked_oracle.py:
Python integers for the block sums, Python floats for the ascending float64 combine), bit for bit
on every element: ``v`` of the blocked linear with a float output and the codes of the blocked
group's readers (incl. a Relu's narrowed range).

Each kernel variant this CPU runs is forced (``dal.npu.load(..., kernel=name)``): portable / avx2
take the int16 form, avx_vnni / avx512_vnni / amx_int8 the int8 form where the weights minus their
zero point fit [-128, 127] (else the int16 form). Codes at the edges (-128/127, 0/255, int4 -8/7),
nonzero zero points per block, block sizes that do not divide K (a ragged last block) and that are
not a multiple of 4, one row (a decode step) and 128 rows (a prefill).
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import blocked_oracle
from test_blocked_groups import _T, _inputs, _weights

VARIANTS = ("portable", "avx2", "avx_vnni", "avx512_vnni", "amx_int8")

CASES = [  # x dtype, x zero point, weight dtype, K, N, block, rows
    (np.int8, 14, ml_dtypes.int4, 80, 21, 32, 128),    # ragged last block (16 of 32), 2 panels (21 columns)
    (np.int8, -128, ml_dtypes.int4, 96, 33, 32, 1),    # one row; 3 panels, the last holds 1 column
    (np.uint8, 131, ml_dtypes.uint4, 75, 17, 7, 6),    # 11 blocks of 7 (padded to 8), the last of 5
    (np.int8, -3, np.int8, 40, 16, 16, 9),             # weights minus zero point up to 255: int16 form
    (np.uint8, 0, np.uint8, 37, 5, 5, 4),              # 8 blocks, the last of 2
    (np.int8, 127, ml_dtypes.int4, 256, 24, 32, 128),  # the tiny Llama's block and K
]


def _model(x_dt, zx, sx, wq, ws, wz, block, sy, relu):
    """xq -> DQ -> MatMul(., DQ(wq blocked along axis 0)) = "mm" (a graph output: the blocked linear
    with a float output); a second model: MatMul [-> Relu] -> QuantizeLinear(sy, zy 3, int8) and
    QuantizeLinear(sy * 1.5, zy 120, uint8) (a blocked group with two readers)."""
    mk = helper.make_node
    inits = [numpy_helper.from_array(np.float32(sx), "sx"), numpy_helper.from_array(np.array(zx, x_dt), "zx"),
             numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"), numpy_helper.from_array(wz, "wz")]
    nodes = [mk("DequantizeLinear", ["xq", "sx", "zx"], ["x"], name="x_dq"),
             mk("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="w_dq", axis=0, block_size=block),
             mk("MatMul", ["x", "w"], ["mm"], name="matmul")]
    if sy is None:
        outs = [helper.make_tensor_value_info("mm", TensorProto.FLOAT, None)]
    else:
        last = "mm"
        if relu:
            nodes.append(mk("Relu", ["mm"], ["act"], name="relu"))
            last = "act"
        inits += [numpy_helper.from_array(np.float32(sy), "sy0"), numpy_helper.from_array(np.int8(3), "zy0"),
                  numpy_helper.from_array(np.float32(sy * 1.5), "sy1"), numpy_helper.from_array(np.uint8(120), "zy1")]
        nodes += [mk("QuantizeLinear", [last, "sy0", "zy0"], ["y0"], name="q0"),
                  mk("QuantizeLinear", [last, "sy1", "zy1"], ["y1"], name="q1")]
        outs = [helper.make_tensor_value_info("y0", TensorProto.INT8, None),
                helper.make_tensor_value_info("y1", TensorProto.UINT8, None)]
    g = helper.make_graph(nodes, "blocked", [helper.make_tensor_value_info("xq", _T[np.dtype(x_dt)], None)],
                          outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


@functools.lru_cache(maxsize=None)
def _case(i):
    """(inputs, model args, the oracle's v) of CASES[i], computed once for every variant."""
    x_dt, zx, w_dt, k, n, block, rows = CASES[i]
    rng = np.random.default_rng(100 + i)
    wq, ws, wz = _weights(rng, k, n, block, w_dt)
    xq = _inputs(rng, rows, k, x_dt)
    xq[-1, : k // 2] = xq[0, 1]  # a row of the highest code then the lowest (edge codes)
    xq[-1, k // 2:] = xq[0, 0]
    sx = np.float32(0.029)
    v = blocked_oracle.block_values(xq, zx, wq, wz, ws, block, sx)
    return xq, (x_dt, zx, sx, wq, ws, wz, block), v


def _load(model, variant, threads=1):
    import dal.npu as npu
    from dal.npu.dispatch import supported
    if variant not in supported():
        pytest.skip(f"this CPU does not run the {variant} kernels")
    return npu.load(model, threads=threads, kernel=variant)


def _blocked(s):
    steps = [st for st in s.steps if st.kind in ("fused", "blocked_float")]
    assert len(steps) == 1
    return steps[0]


def _bits(a):
    return np.asarray(a, np.float32).view(np.int32)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("i", range(len(CASES)))
def test_float_output_equals_numpy_and_oracle(i, variant, npu_lib):
    """``v`` by the forced variant == the numpy path == the SPEC formula, every element's bits."""
    xq, args, v = _case(i)
    s = _load(_model(*args, sy=None, relu=False), variant)
    step = _blocked(s)
    assert step.kernel is not None and step.kernel.isa == VARIANTS.index(variant)
    w_int = args[3].astype(np.int64) - args[5].astype(np.int64)[np.arange(xq.shape[1]) // args[6]]
    fits8 = w_int.min() >= -128 and w_int.max() <= 127
    assert step.kernel.vnni == (fits8 and variant in ("avx_vnni", "avx512_vnni", "amx_int8"))
    got = s.run({"xq": xq})[0]
    np.testing.assert_array_equal(_bits(got), _bits(v))
    np.testing.assert_array_equal(_bits(step.value_numpy(xq)), _bits(v))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("i", [0, 2, 3])
def test_reader_codes_equal_the_oracle(i, relu, variant, npu_lib):
    """Two readers' codes (int8 and uint8, own scales and zero points; a Relu narrows [lo, hi]) by
    the kernel's requantizer == the numpy path's == the SPEC formula; the step's extra outputs
    (return_intermediates) are the numpy path's ``v``."""
    xq, args, v = _case(i)
    sy = np.float32(np.abs(v).max() / 90)
    s = _load(_model(*args, sy=sy, relu=relu), variant)
    step = _blocked(s)
    assert step.kernel is not None and step.kernel.readers is not None
    y0, y1 = s.run({"xq": xq})
    vr = np.maximum(v, np.float32(0)) if relu else v
    np.testing.assert_array_equal(y0.astype(np.int64), blocked_oracle.codes(vr, sy, 3, 3 if relu else -128, 127))
    np.testing.assert_array_equal(y1.astype(np.int64),
                                  blocked_oracle.codes(vr, np.float32(sy * 1.5), 120, 120 if relu else 0, 255))
    kernel, step.kernel = step.kernel, None  # the numpy path, same step
    try:
        n0, n1 = s.run({"xq": xq})
    finally:
        step.kernel = kernel
    np.testing.assert_array_equal(y0, n0)
    np.testing.assert_array_equal(y1, n1)
    vals = s.run({"xq": xq}, return_intermediates=True)[1]
    np.testing.assert_array_equal(_bits(vals["mm"]), _bits(v))


def test_threads_and_batch_shape(npu_lib):
    """Two threads split the tiles differently: the same bits; a [2, M, K] input is M rows twice."""
    xq, args, v = _case(0)
    s1 = _load(_model(*args, sy=None, relu=False), "portable")
    import dal.npu as npu
    s2 = npu.load(_model(*args, sy=None, relu=False), threads=2)
    np.testing.assert_array_equal(_bits(s2.run({"xq": xq})[0]), _bits(v))
    np.testing.assert_array_equal(_bits(s1.run({"xq": xq})[0]), _bits(v))
    x3 = np.stack([xq, xq[::-1]])
    got = s2.run({"xq": x3})[0]
    assert got.shape == (2,) + v.shape
    np.testing.assert_array_equal(_bits(got[0]), _bits(v))
    np.testing.assert_array_equal(_bits(got[1]), _bits(v[::-1]))


def test_int4_input_codes_take_the_numpy_path(npu_lib):
    """int4 activation codes: no kernel (it reads 8-bit codes), the numpy path, the oracle's bits."""
    import dal.npu as npu
    rng = np.random.default_rng(7)
    wq, ws, wz = _weights(rng, 48, 5, 32, ml_dtypes.int4)
    xq = _inputs(rng, 3, 48, ml_dtypes.int4)
    s = npu.load(_model(ml_dtypes.int4, 2, np.float32(0.1), wq, ws, wz, 32, sy=None, relu=False), threads=1)
    assert _blocked(s).kernel is None
    v = blocked_oracle.block_values(xq, 2, wq, wz, ws, 32, np.float32(0.1))
    np.testing.assert_array_equal(_bits(s.run({"xq": xq})[0]), _bits(v))


def test_bad_input_names_the_node(npu_lib):
    """Codes of the wrong type or length: NPUError naming the node, before any C++ call."""
    import dal.npu as npu
    from dal.npu.errors import NPUError
    xq, args, v = _case(2)
    s = npu.load(_model(*args, sy=None, relu=False), threads=1)
    with pytest.raises(NPUError, match="matmul.*reduction length"):
        s.run({"xq": xq[:, :-1]})


def test_malformed_arguments_raise_not_crash(npu_lib):
    """The C++ entry point checks every shape, type and range itself: a RuntimeError naming the
    argument, never a crash (what a caller other than blocked_kernel.py might pass)."""
    import torch

    from dal.npu.blocked_kernel import pack
    f = npu_lib.blocked_gemm
    w = np.zeros((40, 20), np.int64)
    wp8, wsum = pack(w, 16, True)  # 3 blocks of 16 (the last of 8), 2 panels
    wp16, _ = pack(w, 16, False)
    ws = torch.ones((3, 32), dtype=torch.float64)
    x = torch.zeros((4, 40), dtype=torch.int8)
    none = (torch.empty(0, dtype=torch.float32),) + (torch.empty(0, dtype=torch.int64),) * 4
    ok = (x, 0, wp8, wsum, ws, 16, 20, 0.5, *none, 1, 0)
    assert f(*ok)[0].shape == (4, 20)

    def bad(match, **kw):
        a = list(ok)
        for name, val in kw.items():
            a[["x", "zx", "wp", "wsum", "ws", "b", "n", "sx"].index(name)] = val
        with pytest.raises(RuntimeError, match=match):
            f(*a)

    bad("X must be", x=x.to(torch.int32))
    bad("X must be", x=torch.zeros((40,), dtype=torch.int8))
    bad("do not cover", x=torch.zeros((4, 60), dtype=torch.int8))
    bad("do not cover", b=8)
    bad("packed blocks hold", b=17)  # 3 blocks of 17 cover 40, the packing holds 16 rows each
    bad("Wp must be", wp=wp8[..., :2].contiguous())
    bad("panels do not hold", n=40)
    bad("ws must be", ws=ws[:2].contiguous())
    bad("ws must be", ws=ws.float())
    bad("needs wsum", wsum=wsum[:, :16].contiguous())
    bad("zero point", zx=1 << 20)
    a = list(ok)
    a[2], a[3] = wp16, torch.empty(0, dtype=torch.int32)
    assert torch.equal(f(*a)[0], f(*ok)[0])  # the int16 form needs no wsum
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
    for readers, match in [((torch.tensor([0.0]), i64(0), i64(-128), i64(127), i64(2)), "finite and > 0"),
                           ((torch.tensor([1.0]), i64(0), i64(-128), i64(127), i64(3)), "out_code"),
                           ((torch.tensor([1.0]), i64(0), i64(0), i64(300), i64(1)), "outside the code range"),
                           ((torch.tensor([1.0]), i64(0, 1), i64(0), i64(1), i64(1)), "readers need")]:
        with pytest.raises(RuntimeError, match=match):
            f(*ok[:8], *readers, 1, 0)
    with pytest.raises(RuntimeError, match="does not exist"):
        f(*ok[:-1], 9)
