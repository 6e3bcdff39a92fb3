"""A group read by k >= 2 QuantizeLinear nodes (fan-out): one exact accumulator, requantized
once per reader (export/SPEC.md, integer groups), against onnxruntime (ORT_DISABLE_ALL),
onnx.reference and a float64 numpy model of the integer semantics written here."""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphs import ACT, Builder
from oracles import ort_values, run_ort, run_reference

CIN, COUT, HW = 8, 16, 10


@pytest.fixture(autouse=True, params=["shared", "per_reader"])
def share(request, monkeypatch):
    """Both fan-out paths: one accumulator requantized k times, and k fused-kernel runs."""
    from dal.npu import fan_out
    monkeypatch.setattr(fan_out, "SHARE_MIN_K", 0 if request.param == "shared" else 10**9)
    return request.param


def _q_reader(b, y, s, dt, zp):
    return b.node("QuantizeLinear", [y, b.init(np.float32(s), "s"), b.init(np.array(zp, dtype=dt), "z")])


def fan_model(k=2, act="u8", out="u8", tail=None, third=None, downstream=False, fixed=None, seed=0,
              post=None):
    """x -> QDQ -> Conv(int32 bias) [-> Relu | Clip] -> k QuantizeLinear (distinct scales), each a
    graph output; ``third`` adds a non-Q reader ("Sigmoid"); ``downstream`` puts a second conv
    group behind reader 0 (its codes may then stay pixel-major); ``fixed`` the rounding of a
    31-bit fixed-point requantizer; ``post`` "maxpool" (3x3, stride 2, pad 1) or "resize" (nearest
    2x) between the activation and the readers. Returns (model, params for the numpy model)."""
    b = Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, CIN, HW, HW])
    dx, sx = b.qdq("x")
    dw, sw = b.weight((COUT, CIN, 3, 3), "s8", True)
    bq = b.rng.integers(-2000, 2000, size=COUT).astype(np.int32)
    bs = (np.float32(sx) * sw.astype(np.float32)).astype(np.float32)
    db = b.node("DequantizeLinear", [b.init(bq, "b"), b.init(bs, "bs"), b.init(np.zeros(COUT, np.int32), "bz")], axis=0)
    y = b.node("Conv", [dx, dw, db], pads=[1, 1, 1, 1])
    bounds = (None, None)
    if tail == "relu":
        y, bounds = b.node("Relu", [y]), (0.0, None)
    elif tail == "clip":
        y, bounds = b.node("Clip", [y, b.init(np.float32(-0.25)), b.init(np.float32(0.75))]), (-0.25, 0.75)
    if post == "maxpool":
        y = b.node("MaxPool", [y], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    elif post == "resize":
        y = b.node("Resize", [y, "", b.init(np.array([1, 1, 2, 2], np.float32))], mode="nearest")
    dt, onnx_t, zp = ACT[out]
    readers = []
    for r in range(k):
        s = np.float32(b.rng.uniform(0.004, 0.03))
        z = zp + 7 * r if out == "u8" else zp - 5 * r
        readers.append((_q_reader(b, y, s, dt, z), s, z))
    outs = [(q, onnx_t) for q, _, _ in readers]
    if third:
        outs.append((b.node(third, [y]), TensorProto.FLOAT))
    if downstream:
        d0 = b.node("DequantizeLinear", [readers[0][0], b.init(readers[0][1], "s"), b.init(np.array(readers[0][2], dtype=dt), "z")])
        dw2, _ = b.weight((4, COUT, 1, 1), "s8", True)
        outs.append((_q_reader(b, b.node("Conv", [d0, dw2]), 0.05, dt, zp), onnx_t))
    g = helper.make_graph(b.nodes, "fan", [x], [helper.make_tensor_value_info(o, t, None) for o, t in outs], b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    if fixed:
        m.metadata_props.append(onnx.StringStringEntryProto(key="dal.requantizer", value=json.dumps(
            {"kind": "fixed_point", "multiplier_bits": 31, "rounding": fixed})))
    w = onnx.numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == b.nodes[2].input[0]))
    return m, dict(sx=sx, zx=ACT[act][2], xdt=ACT[act][0], w=w, sw=sw, bq=bq, bounds=bounds, readers=readers, dt=dt, fixed=fixed,
                post=post)


def _exact_acc(x, p):
    """int64 accumulators [N, C, H, W] of the 3x3 pad-1 conv on the input codes, + bias codes."""
    lo, hi = np.iinfo(p["xdt"]).min, np.iinfo(p["xdt"]).max
    xq = np.clip(np.rint(x / p["sx"]) + p["zx"], lo, hi).astype(np.int64) - p["zx"]  # rint: half even
    xp = np.pad(xq, ((0, 0), (0, 0), (1, 1), (1, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # N, C, H, W, 3, 3
    return np.einsum("nchwij,ocij->nohw", win, p["w"].astype(np.int64)) + p["bq"].reshape(1, -1, 1, 1)


def _codes(acc, p, s_y, zp):
    """One reader's codes from the exact accumulators (the integer semantics, float64 numpy)."""
    qmin, qmax = np.iinfo(p["dt"]).min, np.iinfo(p["dt"]).max
    q_of = lambda v: int(np.clip(np.rint(np.float32(v) / np.float32(s_y)) + zp, qmin, qmax))
    lo = qmin if p["bounds"][0] is None else max(qmin, q_of(p["bounds"][0]))
    hi = qmax if p["bounds"][1] is None else min(qmax, q_of(p["bounds"][1]))
    mult = np.float64(p["sx"]) * p["sw"].astype(np.float64)
    if not p["fixed"]:
        v = (acc.astype(np.float64) * mult.reshape(1, -1, 1, 1)).astype(np.float32)
        return np.clip(np.rint(v / np.float32(s_y)) + zp, lo, hi).astype(np.int64)
    out = np.empty_like(acc)
    for c in range(acc.shape[1]):  # m = round(f * 2^31), n = 31 - e from M = f * 2^e (frexp)
        f, e = math.frexp(float(mult[c] / np.float64(s_y)))
        m, n = round(f * 2**31), 31 - e
        prod = acc[:, c].astype(object) * m
        half = 1 << (n - 1)
        r = (prod + half) // 2**n if p["fixed"] == "half_up" else None
        if p["fixed"] == "half_even":
            fl, rem = prod // 2**n, prod % 2**n
            r = fl + ((rem > half) | ((rem == half) & (fl % 2 == 1)))
        out[:, c] = np.asarray(r, dtype=np.int64)
    return np.clip(out + zp, lo, hi)


def _post(q, p):
    """The pass-through on codes [N, C, H, W] (max over each 3x3 stride-2 pad-1 window, padding
    never wins; or every element repeated 2x2: half_pixel nearest at scale 2)."""
    if p["post"] == "resize":
        return q.repeat(2, axis=2).repeat(2, axis=3)
    if p["post"] == "maxpool":
        qp = np.pad(q, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=np.iinfo(np.int64).min)
        win = np.lib.stride_tricks.sliding_window_view(qp, (3, 3), axis=(2, 3))[:, :, ::2, ::2]
        return win.max(axis=(4, 5))
    return q


def _x(n=2, seed=1):
    return np.random.default_rng(seed).standard_normal((n, CIN, HW, HW)).astype(np.float32) * 2


CASES = [(k, act, out, tail) for k in (2, 3) for act, out in (("u8", "u8"), ("s8", "s8"), ("u8", "s8"))
         for tail in (None, "relu", "clip")]


@pytest.mark.parametrize("k,act,out,tail", CASES)
def test_fan_out_float_requantizer(k, act, out, tail, npu_lib):
    import dal.npu as npu
    m, p = fan_model(k, act, out, tail)
    sess = npu.load(m, threads=1)
    fused = [s for s in sess.steps if s.kind == "fused"]
    assert len(fused) == 1 and len(fused[0].outputs) == k  # one group, k results
    assert fused[0].steps[0].fast  # the fused kernel's accumulators, requantized k times
    nodes = [s.node.op_type for s in sess.steps if s.kind == "node"]
    assert not {"Conv", "Relu", "Clip"} & set(nodes) and nodes.count("QuantizeLinear") == 1  # x's only
    x = _x()
    mine = sess.run({"x": x})
    again, _ = sess.run({"x": x}, return_intermediates=True)  # the per-reader path
    acc = _exact_acc(x, p)
    ort, ref = run_ort(m, {"x": x}), run_reference(m, {"x": x})
    for r, (_, s, z) in enumerate(p["readers"]):
        want = _codes(acc, p, s, z)
        assert np.array_equal(mine[r].astype(np.int64), want), f"reader {r} vs the integer semantics"
        assert np.array_equal(again[r], mine[r])
        for oracle in (ort, ref):
            assert np.abs(mine[r].astype(np.int64) - oracle[r].astype(np.int64)).max() <= 1


@pytest.mark.parametrize("fixed", ["half_up", "half_even"])
@pytest.mark.parametrize("k,tail", [(2, "relu"), (3, None), (3, "clip")])
def test_fan_out_fixed_point(k, tail, fixed, npu_lib):
    import dal.npu as npu
    m, p = fan_model(k, "s8", "s8", tail, fixed=fixed, seed=3)
    sess = npu.load(m, threads=1)
    x = _x(seed=2)
    mine = sess.run({"x": x})
    again, _ = sess.run({"x": x}, return_intermediates=True)
    acc = _exact_acc(x, p)
    ort = run_ort(m, {"x": x})  # the float requantizer's graph: within 1 LSB of the fixed point
    for r, (_, s, z) in enumerate(p["readers"]):
        assert np.array_equal(mine[r].astype(np.int64), _codes(acc, p, s, z)), f"reader {r}"
        assert np.array_equal(again[r], mine[r])
        assert np.abs(mine[r].astype(np.int64) - ort[r].astype(np.int64)).max() <= 1


def test_non_q_reader_keeps_the_float_path(npu_lib):
    import dal.npu as npu
    m, _ = fan_model(2, "u8", "u8", "relu", third="Sigmoid")
    sess = npu.load(m, threads=1)
    assert not any(s.kind == "fused" for s in sess.steps)
    assert any(s.kind == "node" and s.node.op_type == "Conv" for s in sess.steps)
    x = _x()
    for a, b in zip(sess.run({"x": x})[:2], run_ort(m, {"x": x})[:2]):
        assert np.abs(a.astype(np.int64) - b.astype(np.int64)).max() <= 1


def test_pre_q_tensor_as_graph_output_keeps_the_float_path(npu_lib):
    import dal.npu as npu
    m, _ = fan_model(2, "u8", "u8", None)
    conv = next(n for n in m.graph.node if n.op_type == "Conv")
    m.graph.output.append(helper.make_tensor_value_info(conv.output[0], TensorProto.FLOAT, None))
    assert not any(s.kind == "fused" for s in npu.load(m, threads=1).steps)


@pytest.mark.parametrize("fixed", [None, "half_up"])
def test_fan_out_into_a_pixel_major_consumer(fixed, npu_lib):
    """Reader 0 feeds another conv group (its codes may stay [N, H, W, C]), batch 3: the same
    codes as the per-reader path and the numpy model."""
    import dal.npu as npu
    m, p = fan_model(2, "u8", "u8", "relu", downstream=True, fixed=fixed, seed=5)
    sess = npu.load(m, threads=1)
    assert sum(s.kind == "fused" for s in sess.steps) == 2
    x = _x(3, seed=4)
    mine = sess.run({"x": x})
    again, _ = sess.run({"x": x}, return_intermediates=True)
    acc = _exact_acc(x, p)
    for r, (_, s, z) in enumerate(p["readers"]):
        assert np.array_equal(mine[r].astype(np.int64), _codes(acc, p, s, z))
    assert all(np.array_equal(a, b) for a, b in zip(mine, again))


@pytest.mark.parametrize("fixed", [None, "half_even"])
@pytest.mark.parametrize("post,k,tail", [("maxpool", 2, "relu"), ("maxpool", 1, None), ("resize", 1, None),
                                         ("resize", 2, "clip"), ("maxpool", 3, "clip")])
def test_pass_through_after_the_group(post, k, tail, fixed, npu_lib):
    """Conv [-> Relu | Clip] -> MaxPool | Resize(nearest) -> Q (or k Q): requantize, then pool /
    resize the codes; equal to the numpy model (pool of the requantized codes) on every element,
    onnxruntime and onnx.reference (float requantizer) within 1 LSB."""
    import dal.npu as npu
    m, p = fan_model(k, "u8", "u8", tail, fixed=fixed, seed=7, post=post)
    sess = npu.load(m, threads=1)
    fused = [s for s in sess.steps if s.kind == "fused"]
    assert len(fused) == 1 and fused[0].post.op_type == ("MaxPool" if post == "maxpool" else "Resize")
    assert not {"Conv", "MaxPool", "Resize"} & {s.node.op_type for s in sess.steps if s.kind == "node"}
    x = _x(2, seed=8)
    mine = sess.run({"x": x})
    again, values = sess.run({"x": x}, return_intermediates=True)
    acc = _exact_acc(x, p)
    oracles = [run_ort(m, {"x": x})] + ([run_reference(m, {"x": x})] if not fixed else [])
    for r, (qn, s, z) in enumerate(p["readers"]):
        assert np.array_equal(mine[r].astype(np.int64), _post(_codes(acc, p, s, z), p)), f"reader {r}"
        assert np.array_equal(again[r], mine[r])
        for o in oracles:
            assert np.abs(mine[r].astype(np.int64) - o[r].astype(np.int64)).max() <= 1
    pool = next(n for n in m.graph.node if n.op_type in ("MaxPool", "Resize"))
    want = ort_values(m, {"x": x})[pool.output[0]]  # the pass-through's float value, asked for
    assert values[pool.output[0]].dtype == np.float32 and values[pool.output[0]].shape == want.shape


def test_pool_with_a_window_in_padding_only_keeps_the_float_path(npu_lib):
    import dal.npu as npu
    m, _ = fan_model(1, "u8", "u8", "relu", post="maxpool")
    pool = next(n for n in m.graph.node if n.op_type == "MaxPool")
    del pool.attribute[:]
    pool.attribute.extend([helper.make_attribute("kernel_shape", [2, 2]), helper.make_attribute("pads", [2, 2, 2, 2])])
    assert not any(s.kind == "fused" for s in npu.load(m, threads=1).steps)


@pytest.mark.parametrize("fixed", [None, "half_up"])
def test_gemm_fan_out(fixed, npu_lib):
    """Gemm(int32 bias) -> Relu -> {Q, Q}: the qgemm accumulators requantized per reader."""
    import dal.npu as npu
    b = Builder(11, "s8")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 40])
    dx, sx = b.qdq("x")
    dw, sw = b.weight((24, 40), "s8", True, axis=0)
    bq = b.rng.integers(-2000, 2000, size=24).astype(np.int32)
    bs = (np.float32(sx) * sw).astype(np.float32)
    db = b.node("DequantizeLinear", [b.init(bq, "b"), b.init(bs, "bs"), b.init(np.zeros(24, np.int32), "bz")], axis=0)
    y = b.node("Relu", [b.node("Gemm", [dx, dw, db], transB=1)])
    readers = [(_q_reader(b, y, s, np.int8, z), s, z) for s, z in ((0.01, -3), (0.023, 5))]
    g = helper.make_graph(b.nodes, "fan", [x], [helper.make_tensor_value_info(q, TensorProto.INT8, None)
                                                for q, _, _ in readers], b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    if fixed:
        m.metadata_props.append(onnx.StringStringEntryProto(key="dal.requantizer", value=json.dumps(
            {"kind": "fixed_point", "multiplier_bits": 31, "rounding": fixed})))
    sess = npu.load(m, threads=1)
    assert [len(s.outputs) for s in sess.steps if s.kind == "fused"] == [2]
    assert next(s for s in sess.steps if s.kind == "fused").steps[0].fast
    xv = np.random.default_rng(3).standard_normal((7, 40)).astype(np.float32)
    w = onnx.numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == b.nodes[2].input[0]))
    xq = np.clip(np.rint(xv / sx) + 3, -128, 127).astype(np.int64) - 3
    acc = (xq @ w.astype(np.int64).T + bq)[:, :, None, None]  # [N, C, 1, 1] for _codes
    p = dict(sx=sx, sw=sw, bounds=(0.0, None), dt=np.int8, fixed=fixed, post=None)
    mine, ort = sess.run({"x": xv}), run_ort(m, {"x": xv})
    for r, (_, s, z) in enumerate(readers):
        assert np.array_equal(mine[r].astype(np.int64), _codes(acc, p, s, z)[:, :, 0, 0]), f"reader {r}"
        assert np.abs(mine[r].astype(np.int64) - ort[r].astype(np.int64)).max() <= 1


def test_resize_sizes_computed_after_the_conv(npu_lib):
    """Conv -> Resize(nearest, sizes = Shape of a tensor the file computes after the Conv) -> Q:
    the group runs where the Resize is, with the run-time sizes."""
    import dal.npu as npu
    m, p = fan_model(1, "u8", "u8", None, seed=9)
    conv_q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0].startswith("conv"))
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, COUT, 2 * HW, 2 * HW])
    # a chain long enough that the file's (and the session's) order computes the sizes last
    nodes = [helper.make_node("Relu", ["z" if k == 0 else f"zr{k}"], [f"zr{k + 1}"], name=f"z_relu{k}") for k in range(8)]
    nodes += [helper.make_node("Shape", ["zr8"], ["z_shape"], name="z_shape"),
             helper.make_node("Resize", [conv_q.input[0], "", "", "z_shape"], ["up"], name="up", mode="nearest")]
    conv_q.input[0] = "up"
    at = [k for k, n in enumerate(m.graph.node) if n is conv_q][0]
    for k, n in enumerate(nodes):
        m.graph.node.insert(at + k, n)
    m.graph.input.append(z)
    sess = npu.load(m, threads=1)
    fused = [s for s in sess.steps if s.kind == "fused"]
    assert len(fused) == 1 and fused[0].post.op_type == "Resize"
    order = [s.node_name for s in sess.steps]
    assert order.index("z_shape") < order.index(fused[0].node_name)
    assert [n.name for n in sess.graph.nodes].index("z_shape") > [n.name for n in sess.graph.nodes].index(fused[0].node_name)
    x = _x(2, seed=10)
    zz = np.zeros((2, COUT, 2 * HW, 2 * HW), np.float32)
    mine = sess.run({"x": x, "z": zz})[0]
    (_, s, zp), = p["readers"]
    want = _post(_codes(_exact_acc(x, p), p, s, zp), dict(p, post="resize"))
    assert np.array_equal(mine.astype(np.int64), want)
    assert np.abs(mine.astype(np.int64) - run_ort(m, {"x": x, "z": zz})[0].astype(np.int64)).max() <= 1


def test_crop_and_resize_is_not_a_pass_through(npu_lib):
    """tf_crop_and_resize writes its extrapolation value (a float) outside the crop, which is not
    a code: such a Resize keeps the float path (the Conv group does not reach past it)."""
    import dal.npu as npu
    m, _ = fan_model(1, "u8", "u8", None, post="resize")
    rs = next(n for n in m.graph.node if n.op_type == "Resize")
    rs.attribute.append(helper.make_attribute("coordinate_transformation_mode", "tf_crop_and_resize"))
    sess = npu.load(m, threads=1)
    assert [s for s in sess.steps if s.kind == "node" and s.node.op_type == "Resize"]
    assert not [s for s in sess.steps if getattr(s, "post", None) is not None]


def test_nan_clip_bound_is_refused_by_name(npu_lib):
    """A NaN Clip bound after a Conv group would become a platform-defined code: refused at load,
    naming the Clip."""
    import dal.npu as npu
    m, _ = fan_model(1, "u8", "u8", "clip")
    clip = next(n for n in m.graph.node if n.op_type == "Clip")
    init = next(t for t in m.graph.initializer if t.name == clip.input[2])
    init.CopyFrom(numpy_helper.from_array(np.float32(np.nan), init.name))
    with pytest.raises(npu.NPUError, match=f"{clip.name}.*NaN"):
        npu.load(m, threads=1)


def test_overflowing_shared_accumulator_is_named_by_the_per_reader_path(share, npu_lib):
    """A bias code at the int32 edge overflows the accumulator of a fan-out group: the shared path's
    kernel raises its overflow flag, fan_out falls back to the per-reader run, and that names the
    Conv and the outputs, as a group read once does (tests/npu/test_bias_overflow.py)."""
    import dal.npu as npu
    m, p = fan_model(2, "u8", "u8")
    conv = next(n for n in m.graph.node if n.op_type == "Conv")
    bias_dq = next(n for n in m.graph.node if n.output[0] == conv.input[2])
    init = next(t for t in m.graph.initializer if t.name == bias_dq.input[0])
    edge = np.full(COUT, 2**31 - 1, np.int32)
    init.CopyFrom(numpy_helper.from_array(edge, init.name))
    acc = _exact_acc(_x(), {**p, "bq": np.zeros(COUT, np.int32)})
    assert (acc > 0).any()  # some accumulator pushes the edge bias past 2^31 - 1
    with pytest.raises(npu.NPUError, match=f"node {conv.name!r}.*overflows int32"):
        npu.load(m, threads=1).run({"x": _x()})
