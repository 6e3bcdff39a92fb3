"""Pixel-major activations between integer steps (dal/npu/layout.py) and the C++ input
quantizer (csrc/quantize.cpp): a layout never changes a value.

* A chain conv 3x3 -> conv 1x1 -> MaxPool -> Add -> conv runs pixel-major between its steps;
  every tensor it names equals the NCHW session's bit for bit, for each kernel variant this
  CPU runs, batch 2, one and two threads, u8 and s8 activations, and layer by layer it is
  within 1 LSB of onnxruntime (ORT_DISABLE_ALL), which has no idea of the layout.
* The C++ QuantizeLinear equals onnxruntime's on ties, infinities, huge and tiny values (and
  onnx.reference's where it does not wrap), in both layouts and every variant; NaN is left to quant.py.
* The pixel-major MaxPool equals the NCHW one on odd geometries (padding, dilation, channel
  counts around the 64-channel block), uint8 and int8.
* Each layout of qconv (in and out, NCHW or pixel-major) gives the same codes and int32
  accumulators (equal to numpy's int64 sums), for every variant this CPU runs (amx_int8
  included), including the in-place uint8 1x1 path, the four-panel zmm tile with channel
  counts that leave one- and two-panel remainders, and AMX edge tiles (pixels not a multiple
  of 32, an odd panel count, reductions not a multiple of 64 bytes).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
import oracles


def _chain_model(act, seed=0, cin=5, c1=20, cout=80, hw=13):
    b = graphs.Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", cin, hw, hw])
    dx, sx = b.qdq("x")
    dw, sw = b.weight((c1, cin, 3, 3))
    a, sa = b.qdq(b.node("Relu", [b.node("Conv", [dx, dw, b.bias(c1, sx, sw)], pads=[1, 1, 1, 1])]))
    dw, sw = b.weight((c1, c1, 1, 1))
    p, sp = b.qdq(b.node("Conv", [a, dw, b.bias(c1, sa, sw)]))  # 1x1, no padding: read in place
    m, _ = b.qdq(b.node("MaxPool", [p], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    dw, sw = b.weight((c1, c1, 1, 1))
    d, _ = b.qdq(b.node("Conv", [a, dw, b.bias(c1, sa, sw)], strides=[2, 2]))
    s, ss = b.qdq(b.node("Relu", [b.node("Add", [m, d])]))
    dw, sw = b.weight((cout, c1, 3, 3))
    y, _ = b.qdq(b.node("Conv", [s, dw, b.bias(cout, ss, sw)], pads=[1, 0, 1, 2], dilations=[1, 2]))
    return b.model([x], y)


def _no_layout(monkeypatch, model, **kw):
    import dal.npu as npu
    from dal.npu import layout
    with monkeypatch.context() as mp:
        mp.setattr(layout, "plan", lambda *a: set())
        return npu.load(model, **kw)


@pytest.mark.parametrize("act", ["u8", "s8"])
def test_pixel_major_chain_equals_nchw(act, monkeypatch, npu_lib):
    import dal.npu as npu
    model = _chain_model(act)
    x = np.random.default_rng(1).standard_normal((2, 5, 13, 13)).astype(np.float32)
    feed = {"x": x}
    ref = _no_layout(monkeypatch, model)
    assert not ref._nhwc
    ro, rv = ref.run(feed, return_intermediates=True)
    for kernel in npu.info()["supported"]:
        for threads in (1, 2):
            s = npu.load(model, kernel=kernel, threads=threads)
            convs = [st for st in s.steps if st.kind == "fused"]
            assert len(s._nhwc) == 6 and all(st.nhwc_in == (True,) for st in convs), s._nhwc
            assert s.steps[0].nhwc_out and not convs[-1].nhwc_out  # the graph output is NCHW
            for a, b in zip(s.run(feed), ro):
                assert np.array_equal(a, b), (kernel, threads)
            o, v = s.run(feed, return_intermediates=True)
            assert set(v) == set(rv)
            for k in rv:
                assert v[k].shape == rv[k].shape and np.array_equal(v[k], rv[k], equal_nan=True), (kernel, k)
    # layer by layer from onnxruntime's own tensors (NCHW in, NCHW out): within 1 LSB
    theirs = oracles.ort_values(model, feed)
    got = npu.load(model).run_layerwise(theirs)
    st = oracles.compare_codes(got, theirs, [n for n in oracles.q_names(model) if n in got])
    assert st["tensors"] == 6 and st["max_lsb"] <= 1, st
    # the oracle's codes forced in: every own tensor NCHW and within 1 LSB
    own = npu.load(model).run_teacher_forced(feed, theirs)
    assert oracles.compare_codes(own, theirs, [n for n in oracles.q_names(model) if n in own])["max_lsb"] <= 1


def _q_model(zp_type, shape):
    zp = np.array(3 if zp_type == TensorProto.INT8 else 131, dtype=np.int8 if zp_type == TensorProto.INT8 else np.uint8)
    g = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("q", zp_type, list(shape))],
        [onnx.numpy_helper.from_array(np.float32(0.0371), "s"), onnx.numpy_helper.from_array(zp, "z")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def _edge_values(shape, seed=0):
    rng = np.random.default_rng(seed)
    s = np.float32(0.0371)
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    flat = x.reshape(-1)
    k = rng.integers(-200, 200, 64).astype(np.float32)
    flat[:64] = (k + np.float32(0.5)) * s  # near ties (float32 products land on both sides)
    flat[64:72] = [np.inf, -np.inf, 3e38, -3e38, 1e-40, -0.0, 0.0, 1e9]
    return x


@pytest.mark.parametrize("zp_type", [TensorProto.UINT8, TensorProto.INT8])
def test_cpp_quantize_equals_oracles(zp_type, npu_lib):
    import torch
    import dal.npu as npu
    from dal.npu.dispatch import NAMES
    shape = (2, 3, 7, 9)
    model = _q_model(zp_type, shape)
    x = _edge_values(shape)
    want = oracles.run_ort(model, {"x": x})[0]
    ok = np.abs(x / np.float32(0.0371)) < 2**30  # beyond, onnx.reference wraps in int32 (quant.py)
    assert np.array_equal(oracles.run_reference(model, {"x": np.where(ok, x, 0)})[0][ok], want[ok])
    zp = 3 if zp_type == TensorProto.INT8 else 131
    code = 2 if zp_type == TensorProto.INT8 else 1
    for kernel in npu.info()["supported"]:
        isa = NAMES.index(kernel)
        got = npu_lib.quantize_codes(torch.from_numpy(x), float(np.float32(0.0371)), zp, code, False, 2, isa).numpy()
        assert np.array_equal(got.view(want.dtype), want), kernel
        got = npu_lib.quantize_codes(torch.from_numpy(x), float(np.float32(0.0371)), zp, code, True, 1, isa).numpy()
        assert np.array_equal(got.view(want.dtype), want.transpose(0, 2, 3, 1)), kernel
        out = npu.load(model, kernel=kernel).run({"x": x})[0]
        assert out.dtype == want.dtype and np.array_equal(out, want)
    with pytest.raises(RuntimeError, match="NaN"):
        npu_lib.quantize_codes(torch.from_numpy(np.full(9, np.nan, np.float32)), 0.5, zp, code, False, 1, -1)


def test_nan_input_falls_back_to_quant_py(npu_lib):
    import dal.npu as npu
    from dal.npu import quant
    model = _q_model(TensorProto.UINT8, (1, 2, 6, 7))
    x = _edge_values((1, 2, 6, 7))
    x.reshape(-1)[5] = np.nan
    s = npu.load(model)
    assert type(s.steps[0]).__name__ == "QuantStep"
    want = quant.quantize(x, np.float32(0.0371), np.array(131, np.uint8), np.uint8)
    assert np.array_equal(s.run({"x": x})[0], want)


POOLS = [  # c, h, w, k, stride, dilation, pads (t, l), dtype
    (64, 12, 12, 3, 2, 1, 1, np.uint8), (70, 9, 11, 3, 1, 2, 2, np.int8), (5, 7, 6, 2, 2, 1, 0, np.uint8),
    (130, 5, 5, 3, 2, 1, 1, np.int8),
]


@pytest.mark.parametrize("cfg", POOLS)
def test_pixel_major_maxpool_equals_nchw(cfg, npu_lib):
    import torch
    c, h, w, k, st, dl, p, dt = cfg
    info = np.iinfo(dt)
    rng = np.random.default_rng(c)
    x = rng.integers(info.min, info.max + 1, (2, c, h, w)).astype(dt)
    lut = torch.from_numpy(rng.integers(0, 256, 256).astype(np.uint8))
    base = int(info.min)
    oh = (h + 2 * p - dl * (k - 1) - 1) // st + 1
    ow = (w + 2 * p - dl * (k - 1) - 1) // st + 1
    want = np.stack([npu_lib.maxpool_codes(torch.from_numpy(x[n]), k, k, st, st, dl, dl, p, p, oh, ow, lut, base, 1).numpy()
                     for n in range(2)])
    got = npu_lib.maxpool_codes_nhwc(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 3, 1))), k, k, st, st,
                                     dl, dl, p, p, oh, ow, lut, base, 2).numpy()
    assert np.array_equal(got, want.transpose(0, 2, 3, 1))


CONVS = [  # cin, cout, hw, k, stride, pads, act
    (64, 80, 9, 1, 1, 0, "u8"),    # in place (uint8, 1x1, no padding); 4 + 1 panels
    (64, 96, 9, 1, 2, 0, "s8"),    # int8: the image copy; 4 + 2 panels
    (20, 112, 8, 3, 1, 1, "u8"),   # 4 + 2 + 1 panels, C not a multiple of 16
    (3, 64, 15, 7, 2, 3, "u8"),    # the first conv of a ResNet
    (40, 112, 20, 3, 1, 1, "s8"),  # 800 pixels: several 32-pixel AMX blocks, 7 panels (odd), K % 64 != 0
    (72, 48, 13, 3, 2, 1, "u8"),   # 98 pixels (AMX edge rows 2 of 32), K = 648: 10 full 64-byte steps + tail
    (64, 48, 8, 1, 1, 0, "u8"),    # 128 pixels of a 1x1 conv read in place by the AMX tile loads
]


@pytest.mark.parametrize("cfg", CONVS)
def test_qconv_layouts_agree(cfg, npu_lib):
    import torch
    import dal.npu as npu
    from dal.npu import kernels
    from dal.npu.dispatch import NAMES
    cin, cout, hw, k, st, p, act = cfg
    rng = np.random.default_rng(cin + cout)
    dt = np.uint8 if act == "u8" else np.int8
    info = np.iinfo(dt)
    x = rng.integers(info.min, info.max + 1, (2, cin, hw, hw)).astype(dt)
    zx = 128 if act == "u8" else -3
    w = rng.integers(-127, 128, (cout, cin, k, k))
    wm = kernels.conv_weight_matrix(w, True, 4)
    bp, ws = kernels.pack_panels_s8(wm)
    oh = (hw + 2 * p - k) // st + 1
    e32, ef, e64 = (torch.empty(0, dtype=t) for t in (torch.int32, torch.float32, torch.int64))
    mult = kernels.pad_channels(np.full(cout, 3e-5), cout, np.float64)
    for kernel in npu.info()["supported"]:
        isa = NAMES.index(kernel)
        res = {}
        for lay in range(4):
            xi = x.transpose(0, 2, 3, 1) if lay & 1 else x
            acc = torch.empty(2 * cout * oh * oh, dtype=torch.int32)
            q = npu_lib.qconv(torch.from_numpy(np.ascontiguousarray(xi)), zx, bp, ws, cout, k, k, st, st, 1, 1, p, p,
                              oh, oh, True, mult, e32, ef, e64, e64, 0, 0.07, 9, 0, 255, 1, acc, 2, isa, lay).numpy()
            a = acc.numpy()
            if lay & 2:
                q, a = q.reshape(2, oh * oh, cout).transpose(0, 2, 1), a.reshape(2, oh * oh, cout).transpose(0, 2, 1)
            res[lay] = (q.reshape(2, cout, -1), a.reshape(2, cout, -1))
        # the exact sums, from numpy in int64
        xs = np.pad(x.astype(np.int64) - zx, ((0, 0), (0, 0), (p, p), (p, p)))
        cols = np.stack([xs[:, :, i:i + st * oh:st, j:j + st * oh:st] for i in range(k) for j in range(k)], 2)
        exact = np.einsum("nctp,oct->nop", cols.reshape(2, cin, k * k, -1), w.reshape(cout, cin, k * k))
        for lay in range(4):
            assert np.array_equal(res[lay][0], res[0][0]) and np.array_equal(res[lay][1], res[0][1]), (kernel, lay)
            assert np.array_equal(res[lay][1], exact), (kernel, lay)


def test_pixel_major_requant_flags_bias_overflow(npu_lib):
    """The one-pass requantizer of pixel-major blocks: bias codes at exactly the int32 edge of
    the exact sums (numpy int64) run, one code further is refused, in every layout."""
    import torch
    from dal.npu import kernels
    rng = np.random.default_rng(3)
    cin, cout, hw, zx = 40, 32, 5, 130
    x = rng.integers(0, 256, (1, cin, hw, hw)).astype(np.uint8)
    w = rng.integers(-127, 128, (cout, cin, 1, 1))
    acc = w.reshape(cout, cin) @ (x[0].reshape(cin, -1).astype(np.int64) - zx)
    edge = (2**31 - 1 - acc.max(1)).astype(np.int64)
    bp, ws = kernels.pack_panels_s8(kernels.conv_weight_matrix(w, True, 4))
    e32, ef, e64 = (torch.empty(0, dtype=t) for t in (torch.int32, torch.float32, torch.int64))
    mult = kernels.pad_channels(np.full(cout, 1e-9), cout, np.float64)
    for bump in (0, 1):
        bias = kernels.pad_channels(edge + (np.arange(cout) == 17) * bump, cout, np.int32)
        for lay in range(4):
            xi = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 3, 1) if lay & 1 else x))
            call = lambda: npu_lib.qconv(xi, zx, bp, ws, cout, 1, 1, 1, 1, 1, 1, 0, 0, hw, hw, True, mult, bias, ef,
                                         e64, e64, 0, 0.5, 0, -128, 127, 2, e32, 1, -1, lay)
            if bump:
                with pytest.raises(RuntimeError, match="overflows int32"):
                    call()
            else:
                q = call().numpy()
                want = np.clip(np.rint((acc + edge[:, None]) * 1e-9 / 0.5), -128, 127)  # all near 4.3
                q = q.reshape(hw * hw, cout).T if lay & 2 else q.reshape(cout, -1)
                assert np.array_equal(q, want.astype(np.int8)), lay


def test_run_plans_once_restores_gc_and_rechecks_new_shapes(npu_lib):
    """Session.run's per-session plan (fetch plan, tensors freed after their last reader,
    requantizer arguments, output size per input shape) gives the same codes as a fresh session when one session sees batch 2, then 1, then
    2 again; the cyclic GC is paused only inside run/profile and left as the caller had it,
    also when a run fails."""
    import gc
    import dal.npu as npu
    from dal.npu.errors import NPUError
    model = _chain_model("u8", seed=3)
    rng = np.random.default_rng(4)
    feeds = [{"x": rng.standard_normal((n, 5, 13, 13)).astype(np.float32)} for n in (2, 1, 2)]
    s = npu.load(model, threads=1)
    for feed in feeds:
        fresh = npu.load(model, threads=1).run(feed)
        assert all(np.array_equal(a, b) for a, b in zip(s.run(feed), fresh))
    assert {r["node"] for r in s.profile(feeds[1], repeat=1)} == {st.node_name for st, live in zip(s.steps, s._live) if live}
    was = gc.isenabled()
    try:
        for on in (True, False):
            gc.enable() if on else gc.disable()
            s.run(feeds[0])
            s.profile(feeds[0], repeat=1)
            assert gc.isenabled() == on
            with pytest.raises(NPUError, match="must be float32"):
                s.run({"x": feeds[0]["x"].astype(np.float64)})
            assert gc.isenabled() == on
    finally:
        gc.enable() if was else gc.disable()
    conv = next(st for st in s.steps if st.kind == "fused")
    assert {k[0][0] for k in conv.fast_geo} == {1, 2}  # each batch size checked, once
    dropped = [n for *_, drop in s._fetch_plan(False) for n in drop]  # freed after the last reader
    assert dropped and not set(dropped) & (set(s.graph.outputs) | set(s.graph.inputs))
