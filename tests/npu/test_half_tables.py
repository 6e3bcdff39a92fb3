"""Float16 tables inside float chains (dal/npu/half_tables.py): an FP16 island's SiLU after its Cast to
float16 is looked up in a 65,536-entry table computed by the members themselves.

Oracles: the same graph run node by node (``fuse_chains=False``: ops_float's own functions, each
node's output kept), bit for bit on every float16 pattern (NaN, +-inf, subnormals, signed zeros)
and on random float32 inputs (rounding to float16 included), in both size classes of the Cast's
conversion (torch's from 4096 elements, numpy's below); torch's float64 SiLU as an independent
check of the values (within one float16 ulp: the graph rounds the Sigmoid to float32 first).
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT


def _silu_model(scale=None, bias=None):
    """x -> Cast16 -> Cast32 -> Sigmoid -> Mul(x32, .) [-> Mul(scale)] [-> Add(bias)] -> Cast16 ->
    Cast32 -> y (an FP16 island's SiLU as dal exports it, the Cast32 read by Sigmoid and Mul)."""
    mk = helper.make_node
    nodes = [mk("Cast", ["x"], ["h"], to=F16, name="c16"), mk("Cast", ["h"], ["x32"], to=F32, name="c32"),
             mk("Sigmoid", ["x32"], ["s"], name="sig"), mk("Mul", ["x32", "s"], ["m"], name="mul")]
    inits, last = [], "m"
    if scale is not None:
        inits.append(numpy_helper.from_array(np.asarray(scale, np.float32), "scale"))
        nodes.append(mk("Mul", [last, "scale"], ["ms"], name="mul_scale"))
        last = "ms"
    if bias is not None:
        inits.append(numpy_helper.from_array(np.asarray(bias, np.float32), "bias"))
        nodes.append(mk("Add", [last, "bias"], ["mb"], name="add_bias"))
        last = "mb"
    nodes += [mk("Cast", [last], ["o16"], to=F16, name="o16"), mk("Cast", ["o16"], ["y"], to=F32, name="o32")]
    g = helper.make_graph(nodes, "silu16", [helper.make_tensor_value_info("x", F32, None)],
                          [helper.make_tensor_value_info("y", F32, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _lookups(s):
    return sum(fn.__name__ == "lookup" for st in s.steps if st.kind == "chain" for fn, _, _ in st.program["ops"])


def _inputs():
    """Every float16 pattern as float32 (65,536), then random float32 values (float16 midpoints,
    values past float16's range) to make 2 x 65,536 elements."""
    every = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(65536) * np.exp2(rng.integers(-20, 18, 65536))).astype(np.float32)
    mid = every[:4096].astype(np.float64)
    rand[:4095] = ((mid[:-1] + mid[1:]) / 2).astype(np.float32)  # ties between neighbouring float16 values
    return np.concatenate([every, rand])


@pytest.mark.parametrize("shape", [(2, 256, 256), (1, 16, 128)])  # 131,072 (torch Cast) and 2,048 (numpy Cast)
@pytest.mark.parametrize("scale", [None, 0.75])
def test_silu_table_equals_the_nodes(shape, scale):
    import dal.npu as npu
    m = _silu_model(scale=scale)
    fused, plain = npu.load(m, threads=1), npu.load(m, threads=1, fuse_chains=False)
    assert _lookups(fused) == 1
    x = _inputs()
    for part in np.array_split(x, x.size // int(np.prod(shape))):
        xs = part[: int(np.prod(shape))].reshape(shape)
        got, want = fused.run({"x": xs})[0], plain.run({"x": xs})[0]
        assert got.shape == want.shape == shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_silu_values_against_torch():
    """Independent of dal: torch's float64 SiLU of the float16 input, rounded to float16, within one
    float16 ulp of the table's (the graph rounds its Sigmoid to float32 before the product)."""
    import torch

    import dal.npu as npu
    s = npu.load(_silu_model(), threads=1)
    x = np.arange(65536, dtype=np.uint16).view(np.float16)
    x = x[np.isfinite(x)].astype(np.float32)
    got = s.run({"x": x})[0]
    x64 = torch.from_numpy(x).double()
    want = (x64 * torch.sigmoid(x64)).half().numpy()
    g16 = got.astype(np.float16)
    assert np.array_equal(np.isinf(g16), np.isinf(want))
    fin = np.isfinite(want)
    ulps = np.abs(g16[fin].view(np.int16).astype(np.int32) - want[fin].view(np.int16).astype(np.int32))
    same_sign = np.signbit(g16[fin]) == np.signbit(want[fin])
    assert np.all(ulps[same_sign] <= 1) and np.all(np.abs(want[fin][~same_sign]) < 2 ** -24 * 2)


def test_non_scalar_constant_ends_the_run():
    """A per-channel bias is not a function of one element's bits: the run ends before it; what is
    left (Cast32, Sigmoid, Mul) is still looked up and the result equals the nodes."""
    import dal.npu as npu
    bias = np.linspace(-1, 1, 8, dtype=np.float32)
    m = _silu_model(bias=bias)
    fused, plain = npu.load(m, threads=1), npu.load(m, threads=1, fuse_chains=False)
    chain = next(st for st in fused.steps if st.kind == "chain")
    kinds = [p.node.op_type for p in chain.parts]
    assert kinds == ["Cast", "Cast", "Sigmoid", "Mul", "Add", "Cast", "Cast"]
    assert len(chain.program["ops"]) == 5  # Cast16, one lookup (the Mul's output), Add, Cast16, Cast32
    x = _inputs()[: 8 * 1024].reshape(1024, 8)
    np.testing.assert_array_equal(fused.run({"x": x})[0].view(np.uint32), plain.run({"x": x})[0].view(np.uint32))


def test_short_runs_keep_their_members():
    """A Cast16 -> Cast32 round trip (two members, one tensor handed on) is not looked up."""
    import dal.npu as npu
    mk = helper.make_node
    nodes = [mk("Cast", ["x"], ["h"], to=F16), mk("Cast", ["h"], ["x32"], to=F32),
             mk("Mul", ["x32", "x"], ["y"])]
    g = helper.make_graph(nodes, "rt", [helper.make_tensor_value_info("x", F32, None)],
                          [helper.make_tensor_value_info("y", F32, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    assert _lookups(npu.load(m, threads=1)) == 0


def test_lut16_gathers_the_entries(npu_lib):
    """csrc/lut16.cpp == np.take on every pattern (NaN payloads are table entries: copied as bits);
    malformed arguments raise, never crash."""
    import torch
    rng = np.random.default_rng(3)
    table = rng.integers(0, 2**32, 65536, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaNs too
    keys = np.concatenate([np.arange(65536, dtype=np.uint16), rng.integers(0, 65536, 5000).astype(np.uint16)])
    got = npu_lib.lut16(torch.from_numpy(keys.view(np.float16)), torch.from_numpy(table)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np.take(table, keys).view(np.uint32))
    h = torch.from_numpy(keys.view(np.float16))
    for args, match in [((h.float(), torch.from_numpy(table)), "H must be"),
                        ((h[::2], torch.from_numpy(table)), "H must be"),
                        ((h, torch.from_numpy(table[:-1])), "table must be"),
                        ((h, torch.from_numpy(table).double()), "table must be")]:
        with pytest.raises(RuntimeError, match=match):
            npu_lib.lut16(*args)
