"""A Linear on rank-3 inputs with a bias (a transformer's projections and MLP): torch writes it as
MatMul then Add, and the exporter writes the bias of that Add in the standard QDQ form, int32
codes with DequantizeLinear(scale = float32(s_x) * float32(s_w), zero point 0) (export/SPEC.md §4).
Both integer engines take it as an integer group (exact int32 accumulation plus the bias codes,
the hardware's requantizer) and agree on every element; a float bias leaves it a float island on
both; layer by layer the float engines (onnxruntime, the QAT model) stay within 1 LSB."""
import copy

import numpy as np
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import dal
import dal.npu
from convert_common import assert_bit_exact, build, compare, npu_fused_groups, random_batches
from oracles import ort_values

torch.set_num_threads(1)
SHAPE = (4, 24, 32)  # batch, tokens, features


class TokenMLP(nn.Module):
    """Two Linears applied to every token (rank-3 inputs), with an activation in between."""

    def __init__(self, act: str):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)
        with torch.no_grad():  # biases large enough that an off-grid or missing bias shows
            self.fc1.bias.normal_(0, 0.5)
            self.fc2.bias.normal_(0, 0.5)
        self.act = {"relu": nn.ReLU(), "relu6": nn.ReLU6(), "gelu": nn.GELU()}[act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


_BUILT = {}


def _recipe(act):
    """int8_balanced; GELU through dal.replace's lookup table (a float GELU would read fc1's
    output unquantized, leaving fc1 a float island on both engines)."""
    if act != "gelu":
        return "int8_balanced"
    import yaml
    rec = yaml.safe_load(open(dal.recipe.load.__file__.rsplit("/dal/", 1)[0] + "/recipes/int8_balanced.yaml"))
    rec["name"], rec["replace"] = "int8_balanced+lut", ["lut_activation"]
    return rec


def _built(act, hardware):
    if (act, hardware) not in _BUILT:
        _BUILT[act, hardware] = build(TokenMLP(act), torch.randn(SHAPE), hardware, recipe=_recipe(act))
    return _BUILT[act, hardware]


def _bias_adds(proto):
    """{Linear path: (Add node, bias DequantizeLinear node)} for every MatMul -> Add(DQ) pair."""
    made = {o: n for n in proto.graph.node for o in n.output}
    found = {}
    for n in proto.graph.node:
        if n.op_type != "Add":
            continue
        src = [made.get(i) for i in n.input]
        if any(s is not None and s.op_type == "MatMul" for s in src):
            dq = next((s for s in src if s is not None and s.op_type == "DequantizeLinear"), None)
            if dq is not None:
                found[dq.input[0].rsplit(".bias.codes", 1)[0]] = (n, dq)
    return found


@pytest.mark.parametrize("act,hardware", [("relu", "a2000"), ("relu6", "a2000"), ("gelu", "a2000"),
                                          ("relu", "a1000")])
def test_batched_linear_is_an_integer_group(act, hardware):
    qat, proto, sess = _built(act, hardware)
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    adds = _bias_adds(proto)
    assert set(adds) == {"fc1", "fc2"}, adds
    for path, (_, dq) in adds.items():
        # the standard QDQ bias, scale from the torch model's own quantizers (not from the file)
        lay = qat.get_submodule(path)
        assert inits[dq.input[0]].dtype == np.int32 and not inits[dq.input[2]].any()
        s_x = lay.input_quant.scale.detach().float().reshape(())
        want = (s_x * lay.weight_quant.scale.detach().float().reshape(-1)).numpy()
        np.testing.assert_array_equal(np.broadcast_to(inits[dq.input[1]], want.shape), want)
    # both MatMul + Add pairs are NPU integer groups (the head of the old rule: none was)
    assert npu_fused_groups(sess) == 2, [s.node_name for s in sess.steps]
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches(SHAPE, n=3), f"token mlp {act}/{hardware}")
    assert im.layer_forms() == {"fc1": "integer", "fc2": "integer"}, im.summary()


def test_intermediates_of_the_group():
    """With intermediates asked for, the MatMul output holds no bias and the Add output does
    (the Add and a Relu stay named tensors of the run)."""
    qat, proto, sess = _built("relu", "a2000")
    x = random_batches(SHAPE, n=1)[0].numpy()
    _, vals = sess.run({sess.input_names[0]: x}, return_intermediates=True)
    add, dq = _bias_adds(proto)["fc1"]
    mm = next(i for i in add.input if i != dq.output[0])
    bias = vals[dq.output[0]]
    np.testing.assert_allclose(vals[add.output[0]], vals[mm] + bias, rtol=1e-6, atol=1e-6)
    relu = next(n for n in proto.graph.node if n.op_type == "Relu" and n.input[0] == add.output[0])
    np.testing.assert_array_equal(vals[relu.output[0]], np.maximum(vals[add.output[0]], 0))


def test_layer_by_layer_within_one_lsb_of_the_float_engines():
    """onnxruntime (optimizations off) sums dequantized floats: from the same input codes, each
    group's output codes agree with the NPU's except on near-ties, by at most 1 LSB; dal.verify's
    verdict (integer model == NPU, layer by layer vs the QAT model within 1 LSB) passes."""
    qat, proto, sess = _built("gelu", "a2000")
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    total = off = 0
    for x in random_batches(SHAPE, n=2, seed=5):
        ref = ort_values(proto, {sess.input_names[0]: x.numpy()})
        mine = sess.run_layerwise(ref)
        for name in q_outs:
            if name in mine:
                d = np.abs(mine[name].astype(np.int64) - ref[name].astype(np.int64))
                assert d.max() <= 1, name
                total, off = total + d.size, off + int((d > 0).sum())
    assert total > 20000 and off <= 1e-3 * total, (off, total)
    rep = dal.verify(proto, qat, (random_batches(SHAPE, n=1, seed=9)[0],), onnxruntime=False)
    assert rep.integer.identical and rep.verdict(), rep.verdict_line()


def test_bias_off_by_one_code_is_caught():
    qat, proto, sess = _built("relu", "a2000")
    im = dal.convert(qat)
    bad = copy.deepcopy(proto)
    init = next(t for t in bad.graph.initializer if t.name == "fc2.bias.codes")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + np.int32(1), init.name))
    r = compare(im, bad, dal.npu.load(bad, threads=1), random_batches(SHAPE, n=1)[0])
    assert r["out_diff"] > 0, "a MatMul bias one code off went unnoticed"


def test_float_bias_stays_a_float_island_on_both():
    """bias_mode='float': the exporter writes the Add's bias as a float32 initializer; neither
    engine makes an integer group of it, and they still agree on every element."""
    torch.manual_seed(0)
    model = TokenMLP("relu")
    qat, _, _ = build(model, torch.randn(SHAPE), "a2000")
    qat.get_submodule("fc2").bias_mode = "float"
    proto = dal.export_onnx(qat, (torch.randn(SHAPE),), dynamic_batch=True)
    sess = dal.npu.load(proto, threads=1)
    assert set(_bias_adds(proto)) == {"fc1"}  # fc2's Add reads a float initializer
    assert npu_fused_groups(sess) == 1
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches(SHAPE, n=2), "token mlp float bias")
    forms = im.layer_forms()
    assert forms["fc1"] == "integer" and forms["fc2"].startswith("float"), forms
