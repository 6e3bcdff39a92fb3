"""2:4 sparse weights: the compressed kernel equals the dense kernel bit for bit, and a
weight listed in dal.sparse_24 that is not 2:4 is refused by name."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import graphs


def _make_24(model, axis):
    """Zero 2 of every 4 weight codes along ``axis`` of each int8 weight; return its name."""
    for i, t in enumerate(model.graph.initializer):
        if t.name.startswith("w_"):
            w = numpy_helper.to_array(t).copy()
            g = np.moveaxis(w, axis, -1)
            g = g.reshape(g.shape[:-1] + (-1, 4))
            rng = np.random.default_rng(i)
            keep = np.argsort(rng.random(g.shape), axis=-1)[..., :2]
            mask = np.zeros(g.shape, bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            g = np.where(mask, g, 0).reshape(np.moveaxis(w, axis, -1).shape)
            w = np.moveaxis(g, -1, axis).astype(w.dtype)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, t.name))
            return t.name


def _with_meta(model, name, axis):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.metadata_props.append(onnx.StringStringEntryProto(key="dal.sparse_24", value=json.dumps({name: axis})))
    return m


@pytest.mark.parametrize("k,group,cin", [(3, 1, 8), (1, 1, 16), (3, 2, 16)])
def test_sparse_conv_equals_dense(k, group, cin, npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=7, k=k, group=group, cin=cin, pads=(1, 1, 1, 1) if k == 3 else (0, 0, 0, 0))
    name = _make_24(m, 1)
    x = np.random.default_rng(0).standard_normal((1, cin, 12, 12)).astype(np.float32)
    dense = npu.load(m).run({"x": x}, return_intermediates=True)[1]
    s = npu.load(_with_meta(m, name, 1))
    assert any(st.kind == "fused" and st.conv_w.sparse is not None for st in s.steps)
    sparse = s.run({"x": x}, return_intermediates=True)[1]
    for key in dense:
        assert np.array_equal(dense[key], sparse[key]), key


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_sparse_linear_equals_dense(op, npu_lib):
    import dal.npu as npu
    m = graphs.linear_model(seed=2, op=op, m=7, k=64, n=40)
    axis = 1 if op == "Gemm" else 0  # Gemm weight [N, K] (transB), MatMul weight [K, N]
    name = _make_24(m, axis)
    x = np.random.default_rng(0).standard_normal((7, 64)).astype(np.float32)
    dense = npu.load(m).run({"x": x})[0]
    s = npu.load(_with_meta(m, name, axis))
    assert any(st.kind == "fused" and st.lin_sparse is not None for st in s.steps)
    assert np.array_equal(s.run({"x": x})[0], dense)


def test_not_24_is_refused_by_name(npu_lib):
    import dal.npu as npu
    m = graphs.conv_model(seed=7)
    name = [t.name for t in m.graph.initializer if t.name.startswith("w_")][0]
    with pytest.raises(npu.NPUError, match=name):
        npu.load(_with_meta(m, name, 1))


def test_sparse_kernel_direct(npu_lib):
    import torch
    from dal.npu.sparse import compress_rows
    rng = np.random.default_rng(3)
    for m_, k, n in [(1, 4, 1), (5, 36, 17), (13, 128, 70)]:
        w = rng.integers(-255, 256, (m_, k))
        g = w.reshape(m_, k // 4, 4)
        g[..., rng.permutation(4)[:2]] = 0
        w = g.reshape(m_, k)
        b = rng.integers(-255, 256, (k, n))
        vals, pos = compress_rows(w)
        bp = torch.from_numpy(np.pad(b, ((0, 0), (0, (-n) % 16))).astype(np.int16))
        got = npu_lib.sparse24_gemm_s16(torch.from_numpy(vals), torch.from_numpy(pos), bp, n, 2).numpy()
        assert np.array_equal(got, w @ b)
