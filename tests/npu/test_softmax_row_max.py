"""The fused softmax member's row maximum (dal/npu/fused_chains.py: torch's amax instead of numpy's
max) against the Softmax node run alone (``fuse_chains=False``), bit for bit: rows of signed zeros,
NaN, +-inf, fully masked (-inf) rows, float16 inputs, several axes, a rank-0 input."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper


def _model(axis, elem=TensorProto.FLOAT):
    mk = helper.make_node
    nodes = [mk("Add", ["x", "x"], ["x2"], name="add"), mk("Softmax", ["x2"], ["s"], axis=axis, name="softmax"),
             mk("Mul", ["s", "s"], ["y"], name="mul")]
    g = helper.make_graph(nodes, "sm", [helper.make_tensor_value_info("x", elem, None)],
                          [helper.make_tensor_value_info("y", elem, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _rows(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 6, 16)) * 3).astype(dtype)
    x[0, 0] = 0.0
    x[0, 1] = -0.0
    x[0, 2, ::2] = -0.0  # +0 and -0 in one row: the maximum's sign may differ, the result not
    x[0, 3] = -np.inf    # a fully masked row: NaN
    x[0, 4, 3] = np.nan
    x[0, 5, 7] = np.inf
    x[1, :, 8:] = -np.inf
    return x


@pytest.mark.parametrize("axis", [-1, 1, 0])
@pytest.mark.parametrize("elem,dtype", [(TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)])
def test_fused_softmax_equals_the_node(axis, elem, dtype):
    import dal.npu as npu
    m = _model(axis, elem)
    fused, plain = npu.load(m, threads=1), npu.load(m, threads=1, fuse_chains=False)
    assert any(st.kind == "chain" for st in fused.steps)
    x = _rows(dtype)
    with np.errstate(all="ignore"):
        got, want = fused.run({"x": x})[0], plain.run({"x": x})[0]
    u = np.uint16 if dtype == np.float16 else np.uint32
    np.testing.assert_array_equal(got.view(u), want.view(u))


def test_rank0_equals_the_node():
    import dal.npu as npu
    m = _model(-1)
    got = npu.load(m, threads=1).run({"x": np.float32(1.5)})[0]
    want = npu.load(m, threads=1, fuse_chains=False).run({"x": np.float32(1.5)})[0]
    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))
