"""The fast paths (one C++ call per Conv/Gemm group with weights packed at load; MaxPool and
elementwise binary ops on codes by lookup table) against the node-by-node / old-kernel paths
they replace, bit for bit, on every tensor the graph names -- and against the oracles."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
import oracles
import zoo


def _sessions(model, monkeypatch, **kw):
    """(fast session, reference session): the second runs the old kernels / node by node."""
    import dal.npu as npu
    from dal.npu import fused_codes
    fast = npu.load(model, **kw)
    with monkeypatch.context() as mp:
        mp.setattr(fused_codes, "match", lambda g, n: None)
        slow = npu.load(model, **kw)
    for st in slow.steps:
        if st.kind == "fused":
            st.fast = False
    return fast, slow


def _same(model, feed, monkeypatch, min_fast=1, **kw):
    fast, slow = _sessions(model, monkeypatch, **kw)
    assert sum(getattr(s, "fast", s.kind == "codes") for s in fast.steps) >= min_fast
    of, vf = fast.run(feed, return_intermediates=True)
    os_, vs = slow.run(feed, return_intermediates=True)
    assert set(vf) == set(vs)
    for k in vs:
        assert vf[k].dtype == vs[k].dtype and vf[k].shape == vs[k].shape, k
        assert np.array_equal(vf[k], vs[k], equal_nan=vf[k].dtype.kind == "f"), k
    # and without intermediates (the codes-only route)
    for a, b in zip(fast.run(feed), os_):
        assert np.array_equal(a, b)
    # the int16 (vpmaddwd) panels where the int8 (VNNI) ones were chosen
    repacked = [st for st in fast.steps if getattr(st, "vnni", False)]
    for st in repacked:
        st._pack_fast(st.w_fast, allow_vnni=False)
    if repacked:
        vf = fast.run(feed, return_intermediates=True)[1]
        for k in vs:
            assert np.array_equal(vf[k], vs[k], equal_nan=vf[k].dtype.kind == "f"), k
    return fast


CONV = [dict(act=a, wtype=w, per_channel=pc, stride=s, dilation=d, pads=p, k=k, cin=ci, cout=co, hw=hw,
             relu=r, clip=c, bias=b)
        for a, w, pc, s, d, p, k, ci, co, hw, r, c, b in [
            ("u8", "s8", True, (1, 1), (1, 1), (1, 1, 1, 1), 3, 32, 40, 13, True, False, True),
            ("s8", "s8", False, (2, 2), (1, 1), (0, 1, 2, 0), 3, 3, 16, 15, False, False, True),
            ("u8", "u8", True, (1, 2), (2, 1), (2, 2, 2, 2), 3, 18, 7, 11, True, False, False),
            ("s8", "s4", True, (1, 1), (1, 1), (0, 0, 0, 0), 1, 64, 33, 9, False, True, True),
            ("u8", "u4", False, (3, 2), (1, 2), (3, 0, 1, 2), 5, 5, 24, 17, True, False, True),
            ("s8", "s8", True, (2, 2), (1, 1), (3, 3, 3, 3), 7, 3, 64, 30, True, False, True),
            ("u8", "s8", True, (1, 1), (1, 1), (0, 0, 0, 0), 1, 17, 1, 5, False, False, True),
        ]]


def test_vnni_chosen_where_available(npu_lib):
    import dal.npu as npu
    s = npu.load(graphs.conv_model(seed=0, cin=16, cout=16))
    st = [x for x in s.steps if x.kind == "fused"][0]
    assert st.fast and st.vnni == (npu_lib.best_isa() >= 2)  # avx_vnni / avx512_vnni: int8 panels


@pytest.mark.parametrize("i", range(len(CONV)))
def test_fused_conv_equals_old_kernels(i, monkeypatch, npu_lib):
    cfg = CONV[i]
    m = graphs.conv_model(seed=10 + i, **cfg)
    x = np.random.default_rng(i).standard_normal((1, cfg["cin"], cfg["hw"], cfg["hw"])).astype(np.float32)
    _same(m, {"x": x}, monkeypatch)


def test_fused_conv_batch_and_threads(monkeypatch, npu_lib):
    m = graphs.conv_model(seed=3, cin=20, cout=24, hw=10)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 3
    x = np.random.default_rng(0).standard_normal((3, 20, 10, 10)).astype(np.float32)
    _same(m, {"x": x}, monkeypatch, threads=2)


@pytest.mark.parametrize("op,wtype,pc,act,m_,k,n", [
    ("Gemm", "s8", True, "u8", 5, 40, 24), ("Gemm", "u8", False, "s8", 1, 33, 1000),
    ("MatMul", "s4", True, "u8", 13, 7, 17), ("MatMul", "s8", False, "s8", 64, 300, 48)])
def test_fused_linear_equals_old_kernels(op, wtype, pc, act, m_, k, n, monkeypatch, npu_lib):
    m = graphs.linear_model(seed=4, act=act, wtype=wtype, per_channel=pc, op=op, m=m_, k=k, n=n, relu=True)
    x = np.random.default_rng(0).standard_normal((m_, k)).astype(np.float32)
    _same(m, {"x": x}, monkeypatch)


def _binary_model(op, act, relu, clip, shape_b=(1, 6, 9, 9), seed=0):
    b = graphs.Builder(seed, act)
    xa = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 9, 9])
    xb = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape_b))
    da, _ = b.qdq("x")
    db, _ = b.qdq("y")
    v = b.node(op, [da, db])
    if relu:
        v = b.node("Relu", [v])
    if clip:
        v = b.node("Clip", [v, b.init(np.float32(-0.3)), b.init(np.float32(0.7))])
    q, _ = b.qdq(v)
    mp, _ = b.qdq(b.node("MaxPool", [q], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    mp2, _ = b.qdq(b.node("MaxPool", [q], kernel_shape=[2, 3], strides=[1, 2], dilations=[2, 1], pads=[0, 1, 1, 0]))
    return b.model([xa, xb], mp) if seed % 2 == 0 else b.model([xa, xb], mp2)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Max", "Min"])
@pytest.mark.parametrize("act", ["u8", "s8"])
def test_code_ops_equal_nodes_and_oracles(op, act, monkeypatch, npu_lib):
    for seed, (relu, clip, shape_b) in enumerate([(True, False, (1, 6, 9, 9)), (False, True, (1, 6, 1, 9)),
                                                  (False, False, (1, 6, 9, 9)), (True, False, (1, 1, 9, 1))]):
        m = _binary_model(op, act, relu, clip, shape_b, seed)
        rng = np.random.default_rng(seed)
        feed = {"x": (2 * rng.standard_normal((1, 6, 9, 9))).astype(np.float32),
                "y": (2 * rng.standard_normal(shape_b)).astype(np.float32)}
        fast = _same(m, feed, monkeypatch, min_fast=2)
        vals = fast.run(feed, return_intermediates=True)[1]
        qn = oracles.q_names(m)
        for who, ov in (("ort", oracles.ort_values(m, feed)), ("ref", oracles.ref_values(m, feed))):
            r = oracles.compare_codes(vals, ov, qn)
            assert r["differ"] == 0, (who, seed, r)


@pytest.mark.parametrize("act", ["u8", "s8"])
@pytest.mark.parametrize("relu", [True, False])
def test_code_op_read_by_several_quantizers(act, relu, monkeypatch, npu_lib):
    """A residual sum read by two quantizers of different scales (the next conv's input and the
    next sum's) becomes two code steps, each bit-exact with the nodes and with both oracles; a
    third, float reader of the sum keeps it (and the product that reads it) on the float path."""
    for float_reader in (False, True):
        b = graphs.Builder(3, act)
        xa = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 9, 9])
        xb = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 9, 9])
        v = b.node("Add", [b.qdq("x")[0], b.qdq("y")[0]])
        if relu:
            v = b.node("Relu", [v])
        d1, _ = b.qdq(v, scale=np.float32(0.021))
        d2, _ = b.qdq(v, scale=np.float32(0.0337))
        out = b.node("Mul", [d1, d2])
        if float_reader:
            out = b.node("Sub", [out, v])
        m = b.model([xa, xb], b.qdq(out)[0])
        rng = np.random.default_rng(relu)
        feed = {k: (2 * rng.standard_normal((1, 6, 9, 9))).astype(np.float32) for k in ("x", "y")}
        fast = _same(m, feed, monkeypatch, min_fast=0 if float_reader else 3)
        n_codes = [s.kind for s in fast.steps].count("codes")
        assert n_codes == (0 if float_reader else 3), [s.kind for s in fast.steps]
        vals = fast.run(feed, return_intermediates=True)[1]
        qn = oracles.q_names(m)
        for who, ov in (("ort", oracles.ort_values(m, feed)), ("ref", oracles.ref_values(m, feed))):
            r = oracles.compare_codes(vals, ov, qn)
            assert r["differ"] == 0, (who, float_reader, r)


@pytest.mark.parametrize("act", ["u8", "s8"])
def test_resnet18_fast_equals_old(act, model_dir, monkeypatch, npu_lib):
    m = onnx.load(zoo.torchvision_qdq("resnet18", model_dir, hw=64, activation=act, per_channel=True))
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)
    fast = _same(m, {"input": x}, monkeypatch, min_fast=25)
    kinds = [s.kind for s in fast.steps]
    assert kinds.count("codes") == 11  # 8 Add + MaxPool + GlobalAveragePool (gap_codes.py) + Flatten (shape_codes.py)


def test_fixed_point_fast_equals_old(monkeypatch, npu_lib):
    import json
    for mode in ("half_up", "half_even", "half_away"):
        m = graphs.conv_model(seed=5, act="s8", wtype="s8", cin=24, per_channel=True, relu=False, bias=True)
        m.metadata_props.append(onnx.StringStringEntryProto(key="dal.requantizer", value=json.dumps(
            {"kind": "fixed_point", "multiplier_bits": 15, "rounding": mode})))
        x = np.random.default_rng(0).standard_normal((1, 24, 12, 12)).astype(np.float32)
        _same(m, {"x": x}, monkeypatch)


def test_requantizer_metadata_accepts_nulls():
    import json
    from dal.npu.metadata import Requantizer, read_requantizer
    m = graphs.conv_model(seed=1)
    m.metadata_props.append(onnx.StringStringEntryProto(key="dal.requantizer", value=json.dumps(
        {"kind": "float", "multiplier_bits": None, "rounding": None})))
    assert read_requantizer(m) == Requantizer()
    m.metadata_props[-1].value = json.dumps({"kind": "fixed_point", "multiplier_bits": 16, "rounding": None})
    assert read_requantizer(m) == Requantizer("fixed_point", 16, "half_up")
    m.metadata_props[-1].value = json.dumps({"kind": None})
    assert read_requantizer(m) == Requantizer()
