"""dal.npu's float chains (dal/npu/fused_chains.py): connected float nodes run as one step give,
bit for bit on every element, what the same nodes give run one by one (``fuse_chains=False``):
the exported FP16 RMSNorm island, the SiLU island, the softmax island, rotary embedding and the
head-split Reshape / Transpose chain, on random inputs and on adversarial ones (float16 rounding
midpoints and their float32 neighbours, float16 overflow and subnormals, signed zeros, NaN, +-inf).
Also: integer inputs run the nodes one by one, a chain's failing node is named as without fusion,
and every-tensor runs (return_intermediates) hold each node's output."""
import zlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dal.npu
from dal.npu.errors import NPUError

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _out(name, elem):
    """An output of element type ``elem``, its shape left to inference (no dims named)."""
    vi = onnx.ValueInfoProto(name=name)
    vi.type.tensor_type.elem_type = elem
    vi.type.tensor_type.shape.SetInParent()
    return vi


def _model(nodes, inputs, outputs, consts, opset=21):
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                          [_out(n, t) for n, t in outputs], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m.SerializeToString()


def _half_trip(x, y, tag):
    """The FP16 quantizer of an island: Cast(FLOAT16) -> Cast(FLOAT), as dal's exporter writes it."""
    return [helper.make_node("Cast", [x], [f"{tag}.fp16"], name=f"{tag}/Cast_fp16", to=F16),
            helper.make_node("Cast", [f"{tag}.fp16"], [y], name=f"{tag}/Cast_float", to=F32)]


def rmsnorm(n=256, eps=1e-6):
    rng = np.random.default_rng(1)
    w = rng.normal(1, 0.2, n).astype(np.float16).astype(np.float32)
    nodes = (_half_trip("x", "xq", "in") + [
        helper.make_node("Cast", ["xq"], ["c"], name="Cast", to=F32),
        helper.make_node("Pow", ["c", "two"], ["p"], name="Pow"),
        helper.make_node("ReduceMean", ["p", "axes"], ["ms"], name="ReduceMean", keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["a"], name="Add"),
        helper.make_node("Sqrt", ["a"], ["r"], name="Sqrt"),
        helper.make_node("Div", ["one", "r"], ["inv"], name="Div"),
        helper.make_node("Mul", ["c", "inv"], ["m"], name="Mul"),
        helper.make_node("Cast", ["m"], ["m1"], name="Cast_1", to=F32),
        helper.make_node("Mul", ["m1", "w"], ["mw"], name="Mul_1")] + _half_trip("mw", "y", "out"))
    consts = {"two": np.float32(2), "axes": np.array([-1], np.int64), "eps": np.float32(eps),
              "one": np.float32(1), "w": w}
    return _model(nodes, [("x", F32, [3, 2, n])], [("y", F32)], consts)


def silu():
    nodes = (_half_trip("x", "xq", "in") + [
        helper.make_node("Sigmoid", ["xq"], ["s"], name="Sigmoid"),
        helper.make_node("Mul", ["xq", "s"], ["m"], name="Mul")] + _half_trip("m", "y", "out"))
    return _model(nodes, [("x", F32, [3, 2, 256])], [("y", F32)], {})


def softmax():
    nodes = ([helper.make_node("Add", ["x", "mask"], ["a"], name="Add")] + _half_trip("a", "aq", "in")
             + [helper.make_node("Softmax", ["aq"], ["s"], name="Softmax", axis=-1)] + _half_trip("s", "y", "out"))
    return _model(nodes, [("x", F32, [3, 2, 256]), ("mask", F32, [3, 2, 256])], [("y", F32)], {})


def rotary():
    """HF's rotate_half: y = x * cos + concat(-x[..., 32:], x[..., :32]) * sin, after the head split."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["h"], name="Reshape"),
             helper.make_node("Transpose", ["h"], ["t"], name="Transpose", perm=[0, 2, 1, 3]),
             helper.make_node("Mul", ["t", "cos"], ["xc"], name="Mul"),
             helper.make_node("Slice", ["t", "s0", "e0", "ax"], ["lo"], name="Slice"),
             helper.make_node("Slice", ["t", "s1", "e1", "ax"], ["hi"], name="Slice_1"),
             helper.make_node("Neg", ["hi"], ["nh"], name="Neg"),
             helper.make_node("Concat", ["nh", "lo"], ["rot"], name="Concat", axis=-1),
             helper.make_node("Mul", ["rot", "sin"], ["rs"], name="Mul_1"),
             helper.make_node("Add", ["xc", "rs"], ["y"], name="Add")]
    consts = {"shape": np.array([1, 3, 4, 64], np.int64), "s0": np.array([0], np.int64),
              "e0": np.array([32], np.int64), "s1": np.array([32], np.int64),
              "e1": np.array([2 ** 62], np.int64), "ax": np.array([3], np.int64)}
    return _model(nodes, [("x", F32, [1, 3, 256]), ("cos", F32, [1, 1, 3, 64]), ("sin", F32, [1, 1, 3, 64])],
                  [("y", F32)], consts)


def _f16_midpoints(rng, size):
    """float32 values halfway between adjacent float16 values (ties of the float16 rounding),
    and the float32 values one ulp either side of them."""
    h = rng.integers(0, 0x7BFF, size, dtype=np.uint16).view(np.float16)
    lo, hi = h.astype(np.float32), np.nextafter(h, np.float16(np.inf)).astype(np.float32)
    mid = (lo.astype(np.float64) + hi.astype(np.float64)) / 2  # exact in float32 (float16 has 11 bits)
    mid = mid.astype(np.float32)
    pick = rng.integers(0, 3, size)
    out = np.where(pick == 0, mid, np.where(pick == 1, np.nextafter(mid, np.float32(0)),
                                            np.nextafter(mid, np.float32(np.inf))))
    return np.where(rng.random(size) < 0.5, -out, out).astype(np.float32)


SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 65504.0, 65520.0, 65519.996, 1e5, -1e5,
                     2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -14, 6.1e-5, 1e-30, -1e-30,
                     np.float32(3.4e38), -np.float32(3.4e38)], np.float32)


def _inputs(shape, kind, rng):
    size = int(np.prod(shape))
    if kind == "random":
        x = rng.normal(0, 3, size)
    elif kind == "midpoints":
        x = _f16_midpoints(rng, size)
    elif kind == "specials":
        x = rng.normal(0, 1, size)
        x[rng.random(size) < 0.1] = 0
        idx = rng.choice(size, min(size, 3 * len(SPECIALS)), replace=False)
        x[idx] = np.resize(SPECIALS, len(idx))
    elif kind == "tiny":  # RMSNorm's mean of squares underflowing, eps deciding
        x = rng.normal(0, 1e-4, size) * (rng.random(size) < 0.5)
    else:
        raise ValueError(kind)
    return np.asarray(x, np.float32).reshape(shape)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


BUILDERS = {"rmsnorm": rmsnorm, "silu": silu, "softmax": softmax, "rotary": rotary}


@pytest.fixture(scope="module")
def sessions():
    out = {}
    for name, build in BUILDERS.items():
        m = build()
        out[name] = (dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False))
    return out


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("kind", ["random", "midpoints", "specials", "tiny"])
def test_chain_equals_nodes_one_by_one(sessions, name, kind):
    fused, plain = sessions[name]
    chains = [s for s in fused.steps if s.kind == "chain"]
    assert len(chains) == 1 and len(fused.steps) == 1, [s.kind for s in fused.steps]  # it did fuse
    assert all(s.kind == "node" for s in plain.steps) and len(plain.steps) == len(chains[0].parts)
    rng = np.random.default_rng(zlib.crc32(f"{name} {kind}".encode()))  # the same inputs every run
    for rep in range(3):
        feed = {}
        for inp in fused.graph.input_info.values():
            shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
            feed[inp.name] = _inputs(shape, kind if inp.name == "x" else "random", rng)
        if name == "rotary" and kind == "specials":  # cos / sin with specials too
            feed["sin"] = _inputs(feed["sin"].shape, "specials", rng)
        with np.errstate(all="ignore"):
            want, got = plain.run(feed), fused.run(feed)
        assert chains[0].use_program  # the program ran (float inputs), not the fallback
        assert all(_same(g, w) for g, w in zip(got, want)), (name, kind, rep)


def test_rmsnorm_chain_against_float64_formula(sessions):
    """The fused RMSNorm island against export/SPEC.md's formula computed here in float64 from
    the float16-rounded input: float32(float32(c * float32(1 / float32(sqrt(float32(ms + eps))))) * w),
    ms the float64 mean of the float32 squares, each step rounded to float32 as written."""
    fused, _ = sessions["rmsnorm"]
    rng = np.random.default_rng(5)
    x = _inputs([3, 2, 256], "random", rng)
    (y,) = fused.run({"x": x})
    m = onnx.load_from_string(rmsnorm())
    w = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "w")).astype(np.float64)
    f32 = lambda v: np.asarray(v, np.float64).astype(np.float32).astype(np.float64)
    c = x.astype(np.float16).astype(np.float64)
    ms = f32((f32(c * c)).mean(axis=-1, keepdims=True))
    inv = f32(1.0 / f32(np.sqrt(f32(ms + f32(1e-6)))))
    want = f32(f32(c * inv) * w).astype(np.float16).astype(np.float32)
    assert np.array_equal(y, want)


def test_integer_inputs_run_the_nodes():
    """A chain whose input is not float (a Cast of int64 positions) runs its nodes one by one."""
    nodes = [helper.make_node("Cast", ["i"], ["f"], name="Cast", to=F32),
             helper.make_node("Mul", ["f", "k"], ["y"], name="Mul")]
    m = _model(nodes, [("i", TensorProto.INT64, [4])], [("y", F32)], {"k": np.float32(0.5)})
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    assert [s.kind for s in fused.steps] == ["chain"]
    feed = {"i": np.array([1, -3, 2 ** 40, 7], np.int64)}
    assert _same(fused.run(feed)[0], plain.run(feed)[0])
    assert not fused.steps[0].use_program


def test_failing_member_is_named_as_without_fusion():
    """A broadcasting failure inside a chain raises the NPUError the unfused node raises."""
    nodes = [helper.make_node("Neg", ["x"], ["n"], name="the_neg"),
             helper.make_node("Mul", ["n", "b"], ["m"], name="the_mul"),
             helper.make_node("Sqrt", ["m"], ["y"], name="the_sqrt")]
    m = _model(nodes, [("x", F32, ["a", "b"]), ("b", F32, ["c"])], [("y", F32)], {})
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    assert [s.kind for s in fused.steps] == ["chain"]
    feed = {"x": np.ones((2, 3), np.float32), "b": np.ones((4,), np.float32)}
    with pytest.raises(NPUError) as a:
        plain.run(feed)
    with pytest.raises(NPUError) as b:
        fused.run(feed)
    assert str(a.value) == str(b.value) and "the_mul" in str(b.value)


def test_tensor_read_outside_stays_an_output(sessions):
    """Every tensor another step reads, and every graph output, leaves the chain; every-tensor
    runs hold each node's output, equal to the unfused session's."""
    nodes = [helper.make_node("Neg", ["x"], ["n"], name="neg"),
             helper.make_node("Mul", ["n", "n"], ["m"], name="mul"),
             helper.make_node("Sqrt", ["m"], ["y"], name="sqrt")]
    m = _model(nodes, [("x", F32, [8])], [("y", F32), ("n", F32)], {})
    fused, plain = dal.npu.load(m, threads=1), dal.npu.load(m, threads=1, fuse_chains=False)
    assert fused.steps[0].kind == "chain" and set(fused.steps[0].outputs) == {"n", "y"}
    x = {"x": np.linspace(-3, 3, 8, dtype=np.float32)}
    assert all(_same(a, b) for a, b in zip(fused.run(x), plain.run(x)))
    _, va = fused.run(x, return_intermediates=True)
    _, vb = plain.run(x, return_intermediates=True)
    assert set(va) == set(vb) == {"n", "m", "y"} and all(_same(va[k], vb[k]) for k in va)
    fused_rms = sessions["rmsnorm"][0]
    _, vals = fused_rms.run({"x": np.ones((3, 2, 256), np.float32)}, return_intermediates=True)
    assert "ms" in vals and "in.fp16" in vals
