"""What the two-thread work changed (issue 20), against oracles dal did not write:

* a whole ResNet-18 gives the same bits at 1, 2 and 3 threads (batch 1 and 3), every
  quantized tensor equal to onnxruntime's with optimizations off (csrc/qconv.cpp's static deal
  of tasks and channel split of weight-bound layers, pool_codes.cpp's threaded
  GlobalAveragePool sum, the cached Gemm call, the DequantizeLinear table);
* ``DQ -> Flatten | Reshape -> Q`` as one code step (shape_codes.py), identity table or not,
  equal to onnxruntime and onnx.reference.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
import oracles
import zoo


@pytest.mark.parametrize("act", ["u8", "s8"])
def test_resnet18_same_bits_at_any_thread_count(act, model_dir, npu_lib):
    import dal.npu as npu
    from dal.npu.gap_codes import GapCodes
    from dal.npu.shape_codes import ShapeCodes
    m = onnx.load(zoo.torchvision_qdq("resnet18", model_dir, hw=64, activation=act, per_channel=True))
    x = {"input": np.random.default_rng(7).standard_normal((1, 3, 64, 64)).astype(np.float32)}
    ort = oracles.ort_values(m, x)
    qn = oracles.q_names(m)
    first = None
    for threads in (1, 2, 3):
        s = npu.load(m, threads=threads)
        kinds = {type(st) for st in s.steps}
        assert GapCodes in kinds and ShapeCodes in kinds
        # every quantizer's codes, from the fast run (no intermediates: the fused kernels'
        # one-pass paths) and from the run that returns them all
        out = s.run(x)[0]
        vals = s.run(x, return_intermediates=True)[1]
        r = oracles.compare_codes(vals, ort, qn)
        assert r["differ"] == 0, (threads, r)
        assert np.array_equal(out, ort[m.graph.output[0].name]), threads
        first = out if first is None else first
        assert out.tobytes() == first.tobytes(), threads
    # a batch of 3 (the same file with a free batch dimension): one call per group for the batch
    mb = onnx.ModelProto()
    mb.CopyFrom(m)
    for vi in list(mb.graph.input) + list(mb.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "N"
    del mb.graph.value_info[:]
    xb = {"input": np.random.default_rng(3).standard_normal((3, 3, 64, 64)).astype(np.float32)}
    outs = [npu.load(mb, threads=t).run(xb)[0].tobytes() for t in (1, 2, 3)]
    assert outs[0] == outs[1] == outs[2]


def _shape_model(act, op, same_scale, seed=0):
    """x -> Q/DQ -> Flatten | Reshape -> Q/DQ: the same quantizer parameters on both sides
    (quantize_static's Flatten; identity table) or another scale (a 256-entry table)."""
    b = graphs.Builder(seed, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 3, 1])
    y, s = b.qdq("x")
    if op == "Flatten":
        y = b.node("Flatten", [y], axis=1)
    else:
        y = b.node("Reshape", [y, b.init(np.array([2, 0, -1], np.int64), "shape")])
    y, _ = b.qdq(y, scale=s if same_scale else np.float32(s * 1.37))
    return b.model([x], y)


@pytest.mark.parametrize("act", ["u8", "s8"])
@pytest.mark.parametrize("op", ["Flatten", "Reshape"])
@pytest.mark.parametrize("same_scale", [True, False])
def test_shape_codes_equal_both_oracles(act, op, same_scale):
    import dal.npu as npu
    from dal.npu.shape_codes import ShapeCodes
    m = _shape_model(act, op, same_scale)
    x = {"x": (np.random.default_rng(3).standard_normal((2, 6, 3, 1)) * 2).astype(np.float32)}
    qn = oracles.q_names(m)
    ort, ref = oracles.ort_values(m, x), oracles.ref_values(m, x)
    for threads in (1, 2):
        s = npu.load(m, threads=threads)
        st = [t for t in s.steps if isinstance(t, ShapeCodes)]
        assert len(st) == 1 and (st[0].table is None) == same_scale
        out = s.run(x)[0]
        vals = s.run(x, return_intermediates=True)[1]  # the three nodes one by one
        for who, ov in (("ort", ort), ("ref", ref)):
            assert np.array_equal(out, ov[m.graph.output[0].name]), who
            r = oracles.compare_codes(vals, ov, qn)
            assert r["differ"] == 0, (who, r)
        # the step itself on the codes: the same bits as the node-by-node value
        codes = vals[st[0].inputs[0]]
        got = st[0].run([codes] + [s.graph.consts[i] for i in st[0].inputs[1:]], threads)[st[0].outputs[0]]
        want = vals[st[0].outputs[0]]
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def test_shape_codes_not_for_a_computed_shape():
    """A Reshape whose target shape is computed at run time stays node by node."""
    import dal.npu as npu
    from dal.npu.shape_codes import ShapeCodes
    b = graphs.Builder(1, "u8")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 3, 1])
    y, s = b.qdq("x")
    y = b.node("Reshape", [y, b.node("Shape", ["x"])])
    y, _ = b.qdq(y, scale=s)
    m = b.model([x], y)
    sess = npu.load(m)
    assert not any(isinstance(t, ShapeCodes) for t in sess.steps)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 6, 3, 1)).astype(np.float32)}
    assert np.array_equal(sess.run(feed)[0], oracles.run_ort(m, feed)[0])
