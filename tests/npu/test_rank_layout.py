"""Codes of any rank pass through dal.npu's layout planning (layout.py, ranks.py): only tensors
proven of rank 4 that a 2-D convolution reads or writes are stored pixel-major.

* An ``nn.TransformerEncoder`` (no convolution; rank-3 activations, rank-1 Add operands of its
  LayerNorm / bias after quantize_static) and an MLP with LayerNorm, exported to float ONNX and
  quantized by onnxruntime's ``quantize_static`` (QDQ, a tool dal did not write): dal.npu runs
  them (it refused them: "codes of rank 3 / rank 1 where the graph's convolutions need rank 4"),
  plans nothing pixel-major, and layer by layer (each step from onnxruntime's own tensors,
  ORT_DISABLE_ALL) every code is within 1 LSB of onnxruntime's.
* A hand-built graph: a conv chain with rank-3 codes broadcast into its residual Add, beside an
  Add of two rank-3 graph-input quantizers and one of two rank-4 ones that no conv touches: only
  the conv chain is pixel-major, and every tensor equals the session without any layout bit for
  bit (the old planner raised "codes of rank 3").
* ranks.rank4_names proves rank 4 through convs, rank-keeping nodes and broadcasts, and never
  for the rank-3 / rank-2 tensors of the same graph (shapes from onnx's own shape inference).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphs
import oracles


class _Reader:
    def __init__(self, name, shape, n=4, seed=0):
        rng = np.random.default_rng(seed)
        self._it = iter([{name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)])

    def get_next(self):
        return next(self._it, None)


def _encoder():
    import torch
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False), (2, 7, 32)


def _mlp():
    import torch
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.LayerNorm(48), torch.nn.GELU(),
                               torch.nn.Linear(48, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8)), (5, 24)


def _quantized(make, tmp_path, act):
    import torch
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    torch.manual_seed(0)
    model, shape = make()
    fp, out = str(tmp_path / "f.onnx"), str(tmp_path / f"q_{act}.onnx")
    with torch.no_grad():
        # the encoder's fused fast path (FACTS) is off in the TorchScript exporter's trace of
        # grad-free eval only when the flag says so
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            torch.onnx.export(model.eval(), (torch.randn(shape),), fp, dynamo=False, opset_version=17,
                              input_names=["input"], output_names=["output"])
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    quantize_static(fp, out, _Reader("input", shape), quant_format=QuantFormat.QDQ, per_channel=False,
                    weight_type=QuantType.QInt8,
                    activation_type=QuantType.QUInt8 if act == "u8" else QuantType.QInt8)
    return onnx.load(out), shape


@pytest.mark.parametrize("act", ["u8", "s8"])
@pytest.mark.parametrize("make", [_encoder, _mlp], ids=["transformer_encoder", "mlp_layernorm"])
def test_quantize_static_without_convs_runs_within_1_lsb(make, act, tmp_path, npu_lib):
    import dal.npu as npu
    model, shape = _quantized(make, tmp_path, act)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    feed = {"input": x}
    sess = npu.load(model)
    assert not sess._nhwc  # no convolution: nothing is reordered
    assert sum(s.kind == "fused" for s in sess.steps) >= 2  # the Linear layers run as integer groups
    out = sess.run(feed)[0]
    assert out.shape == oracles.run_ort(model, feed)[0].shape
    # layer by layer: every step from onnxruntime's own tensors
    theirs = oracles.ort_values(model, feed)
    got = sess.run_layerwise(theirs)
    names = [n for n in oracles.q_names(model) if n in got]
    assert len(names) >= 6
    st = oracles.compare_codes(got, theirs, names)
    assert st["max_lsb"] <= 1, st  # near-ties of the float accumulation: 1 LSB at most
    # and end to end the run itself: the codes the session computes from the input
    _, own = sess.run(feed, return_intermediates=True)
    wrong = {n: (own[n].shape, theirs[n].shape) for n in own if n in theirs and own[n].shape != theirs[n].shape}
    assert not wrong, wrong  # every tensor keeps its rank (a scalar's codes stay a scalar)


def _mixed_model(act="u8"):
    """conv 3x3 -> Relu -> conv 1x1 (a rank-4 chain) plus Q(b) of rank 3 (broadcast), next to
    Add(Q(a), Q(c)) on two rank-3 inputs, and Add(Q(d), Q(e)) of rank 4 with no conv."""
    b = graphs.Builder(0, act)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 9, 9])
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 6, 16])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, ["N", 6, 16])
    dx, sx = b.qdq("x")
    dw, sw = b.weight((8, 4, 3, 3))
    h, sh = b.qdq(b.node("Relu", [b.node("Conv", [dx, dw, b.bias(8, sx, sw)], pads=[1, 1, 1, 1])]))
    dw, sw = b.weight((8, 8, 1, 1))
    y, _ = b.qdq(b.node("Conv", [h, dw, b.bias(8, sh, sw)]))
    db, _ = b.qdq("b")  # rank 3, broadcast against the conv's rank-4 codes
    y, _ = b.qdq(b.node("Add", [y, db]))
    da, _ = b.qdq("a")
    dc, _ = b.qdq("c")
    s, _ = b.qdq(b.node("Add", [da, dc]))
    dd, _ = b.qdq("d")  # rank 4, but no convolution reads or writes it
    de, _ = b.qdq("e")
    t, _ = b.qdq(b.node("Add", [dd, de]))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in (y, s, t)]
    ins = [x, helper.make_tensor_value_info("b", TensorProto.FLOAT, [8, 9, 9]), a, c] + [
        helper.make_tensor_value_info(k, TensorProto.FLOAT, ["N", 2, 3, 5]) for k in "de"]
    m = helper.make_model(helper.make_graph(b.nodes, "g", ins, outs, b.inits),
                          opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def test_rank3_codes_beside_a_conv_chain(monkeypatch, npu_lib):
    import dal.npu as npu
    from dal.npu import layout
    model = _mixed_model()
    rng = np.random.default_rng(3)
    feed = {"x": rng.standard_normal((2, 4, 9, 9)).astype(np.float32),
            "a": rng.standard_normal((2, 6, 16)).astype(np.float32),
            "c": rng.standard_normal((2, 6, 16)).astype(np.float32),
            "b": rng.standard_normal((8, 9, 9)).astype(np.float32),
            "d": rng.standard_normal((2, 2, 3, 5)).astype(np.float32),
            "e": rng.standard_normal((2, 2, 3, 5)).astype(np.float32)}
    sess = npu.load(model)
    planned = sess._nhwc
    q_of = {n.input[0]: n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    assert q_of["x"] in planned  # the conv chain is pixel-major
    assert all(q_of[k] not in planned for k in "abc")  # the rank-3 codes are not
    assert q_of["d"] not in planned and q_of["e"] not in planned  # rank 4, but no conv gains from it
    with monkeypatch.context() as mp:
        mp.setattr(layout, "plan", lambda *a, **k: set())
        ref = npu.load(model)
    ro, rv = ref.run(feed, return_intermediates=True)
    o, v = sess.run(feed, return_intermediates=True)
    for p, q in zip(o, ro):
        assert np.array_equal(p, q)
    assert all(np.array_equal(v[k], rv[k]) for k in rv)
    # against onnxruntime, node semantics off the layout: within 1 LSB layer by layer
    theirs = oracles.ort_values(model, feed)
    got = sess.run_layerwise(theirs)
    assert oracles.compare_codes(got, theirs, [n for n in oracles.q_names(model) if n in got])["max_lsb"] <= 1


def test_rank4_proof_matches_shape_inference():
    from dal.npu.graph import Graph
    from dal.npu.ranks import rank4_names
    model = _mixed_model()
    proven = rank4_names(Graph(model))
    inferred = onnx.shape_inference.infer_shapes(model)
    rank = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
            list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
            if vi.type.tensor_type.HasField("shape")}
    rank.update({t.name: len(t.dims) for t in model.graph.initializer})
    assert proven, "the conv chain's tensors are proven"
    assert all(rank[n] == 4 for n in proven), {n: rank[n] for n in proven if rank[n] != 4}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert all(n.input[0] in proven and n.output[0] in proven for n in convs)
    assert not [n for n in rank if rank[n] == 3 and n in proven]
