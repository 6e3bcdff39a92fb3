"""Float islands in the precision the hardware model declares (export/SPEC.md §5a "Precision"):
on the a2000, whose vector engine has ``compute: fp16``, a float op between quantizers (SiLU,
Sigmoid, average pooling, bilinear resize, ...) is an FP16 island, its input and output rounded
to fp16 in the QAT model and written as Cast(FLOAT16) -> Cast(FLOAT) on both sides.

Oracles: the file's structure (onnx), onnxruntime with optimizations off (layer by layer), a
float64 numpy model of the island written here, and dal.npu against dal.convert (two
implementations, one from the file, one from the torch model)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches
from oracles import ort_values

torch.set_num_threads(1)


class SeNet(nn.Module):
    """An EfficientNet block, small: Conv-BN-SiLU, a squeeze-excitation Sigmoid gate (module),
    a functional sigmoid, bilinear upsampling and average pooling, a conv and a classifier."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.SiLU()
        self.gate = nn.Sigmoid()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        y = y * self.gate(y)
        y = self.conv2(F.interpolate(torch.sigmoid(y), scale_factor=2.0, mode="bilinear"))
        return self.fc(torch.flatten(self.pool(F.avg_pool2d(y, 2)), 1))


SHAPE = (2, 3, 8, 8)


def _built(hardware="a2000"):
    torch.manual_seed(0)
    return build(SeNet(), torch.randn(SHAPE), hardware)


def _graph(proto):
    made_by = {o: n for n in proto.graph.node for o in n.output}
    readers = {}
    for n in proto.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    return made_by, readers


def _cast_to(node, to):
    return node is not None and node.op_type == "Cast" and next(a.i for a in node.attribute if a.name == "to") == to


def test_exported_graph_holds_the_casts_around_the_sigmoid():
    """Every Sigmoid reads Cast(FLOAT) of Cast(FLOAT16) and its island ends in Cast(FLOAT16) ->
    Cast(FLOAT); the prepare report says so. The same model on generic_int8 (no compute key:
    fp32) has no Cast at all, as before."""
    qat, proto, _ = _built()
    made_by, readers = _graph(proto)
    sigmoids = [n for n in proto.graph.node if n.op_type == "Sigmoid"]
    assert len(sigmoids) == 3  # SiLU's, the gate's, torch.sigmoid's
    for s in sigmoids:
        c32 = made_by[s.input[0]]
        assert _cast_to(c32, 1) and _cast_to(made_by[c32.input[0]], 10), s.name
        # the island's last node (the SiLU's Mul, or the Sigmoid itself) is read by Cast(FLOAT16)
        last = s if any(_cast_to(r, 10) for r in readers[s.output[0]]) else readers[s.output[0]][0]
        assert last.op_type in ("Sigmoid", "Mul"), s.name
        c16 = next(r for r in readers[last.output[0]] if _cast_to(r, 10))
        assert all(_cast_to(r, 1) for r in readers[c16.output[0]]), s.name
    for op in ("Resize", "GlobalAveragePool", "AveragePool"):
        node = next(n for n in proto.graph.node if n.op_type == op)
        assert _cast_to(made_by[node.input[0]], 1), op
        assert any(_cast_to(r, 10) for r in readers[node.output[0]]), op
    # the ops themselves stay float32 between the round trips: only Casts read float16 tensors
    assert all(n.op_type == "Cast" for n in proto.graph.node for i in n.input if _cast_to(made_by.get(i), 10))
    # an island reading an island's output (the pool after avg_pool2d) rounds nothing again: no
    # Cast(FLOAT16) of a Cast(FLOAT) of a float16 tensor is written
    for n in proto.graph.node:
        if _cast_to(n, 10) and _cast_to(made_by.get(n.input[0]), 1):
            assert not _cast_to(made_by.get(made_by[n.input[0]].input[0]), 10), n.name
    rows = {r.name: r for r in dal.prepared(qat).report.rows}
    assert rows["act"].status == rows["gate"].status == rows["pool"].status == "fp16"
    assert "an FP16 island" in rows["act"].detail and "compute: fp16" in rows["act"].detail
    islands = [r for r in rows.values() if "an FP16 island" in r.detail]
    assert len(islands) == 6, [r.name for r in rows.values()]  # act, gate, sigmoid, interpolate, avg_pool2d, pool
    _, plain, _ = _built("generic_int8")
    assert not [n for n in plain.graph.node if n.op_type == "Cast"]
    assert len([n for n in plain.graph.node if n.op_type == "Sigmoid"]) == 3


def test_island_numerics_against_a_float64_model_and_onnxruntime():
    """From onnxruntime's own values (optimizations off), dal.npu's island outputs equal a float64
    numpy model of SPEC §5a in float16 (``float16(float32(x16 * float32(sigmoid64(x16))))``), and
    every quantized tensor is within 1 LSB of onnxruntime's, layer by layer."""
    qat, proto, sess = _built()
    made_by, readers = _graph(proto)
    silu = next(n for n in proto.graph.node if n.op_type == "Sigmoid" and "/act/" in n.name)
    mul = readers[silu.output[0]][0]
    out16 = next(r for r in readers[mul.output[0]] if _cast_to(r, 10)).output[0]
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    total = off = 0
    for x in random_batches(SHAPE, n=2, seed=7):
        ref = ort_values(proto, {sess.input_names[0]: x.numpy()})
        mine = sess.run_layerwise(ref)
        x16 = ref[silu.input[0]]
        assert x16.dtype == np.float32 and (x16 == x16.astype(np.float16)).all()  # fp16-valued
        s = (1.0 / (1.0 + np.exp(-x16.astype(np.float64)))).astype(np.float32)
        want = (x16 * s).astype(np.float16)
        np.testing.assert_array_equal(mine[out16], want)
        assert (ref[out16] != want).sum() <= 1e-3 * want.size  # onnxruntime's float32 Sigmoid: an ulp now and then
        for name in (n for n in q_outs if n in mine):  # the graph input's Q has no step before it
            d = np.abs(mine[name].astype(np.int64) - ref[name].astype(np.int64))
            assert d.max() <= 1, name
            total, off = total + d.size, off + int((d > 0).sum())
    assert total > 1000 and off <= 1e-3 * total, (off, total)


def test_small_model_integer_model_equals_npu():
    qat, proto, sess = _built()
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches(SHAPE, n=3, seed=11), "SeNet/a2000")
    assert sum(f == "integer" for f in im.layer_forms().values()) == npu_fused_groups(sess)
    assert "FP16 quantizer" in im.summary()  # the conv read by the SiLU island's input


@pytest.mark.parametrize("arch,island", [("efficientnet_b0", "Sigmoid"), ("mobilenet_v3_small", "HardSigmoid")])
def test_torchvision_islands_bit_exact_and_within_one_lsb_of_onnxruntime(arch, island):
    """EfficientNet-B0 (SiLU, squeeze-excitation Sigmoid, average pooling) and MobileNetV3-small
    (HardSwish, written HardSigmoid and Mul, and the squeeze-excitation HardSigmoid) at 32x32: every activation is an FP16 island, the integer model
    equals dal.npu on every element, and dal.npu is within 1 LSB of onnxruntime layer by layer."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    qat, proto, sess = build(getattr(tv.models, arch)(weights=None), torch.randn(1, 3, 32, 32), "a2000")
    made_by, _ = _graph(proto)
    acts = [n for n in proto.graph.node if n.op_type == island]
    assert acts and all(_cast_to(made_by[n.input[0]], 1) for n in acts), arch
    im = dal.convert(qat)
    batches = random_batches((2, 3, 32, 32), n=1, seed=3)
    assert_bit_exact(im, proto, sess, batches, arch)
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    ref = ort_values(proto, {sess.input_names[0]: batches[0].numpy()})
    mine = sess.run_layerwise(ref)
    d = np.concatenate([np.abs(mine[n].astype(np.int64) - ref[n].astype(np.int64)).ravel() for n in q_outs
                        if n in mine])
    assert d.max() <= 1 and (d > 0).sum() <= 1e-3 * d.size, (arch, int((d > 0).sum()), d.size)


class ActNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.act, self.h, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Hardswish(), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return self.c2(self.h(self.act(self.c1(x))))


def _recipe(change: str):
    """int8_balanced with the convs' outputs quantized too ("conv_out": each island then reads
    codes, DQ), or with ``lut_activation`` ("lut": the a1000's table activations, DQ -> f -> Q)."""
    import copy
    import yaml
    rec = copy.deepcopy(yaml.safe_load(open(dal.recipe.load.__file__.rsplit("/dal/", 1)[0]
                                            + "/recipes/int8_balanced.yaml")))
    rec["name"] = f"int8_balanced+{change}"
    if change == "lut":
        rec["replace"] = ["lut_activation"]
    for rule in rec["rules"]:
        if change == "conv_out" and "conv" in rule.get("type", []):
            rule["output"] = dict(rule["input"])
    return rec


@pytest.mark.parametrize("hardware,change,casts", [("a2000", "conv_out", [6]), ("a1000", "lut", [0, 0])])
def test_chains_on_codes_are_table_steps_equal_to_the_nodes(hardware, change, casts):
    """``DQ -> Cast16 -> Cast32 -> Sigmoid -> Mul -> Cast16 -> Cast32 -> HardSigmoid -> Mul ->
    Cast16 -> Cast32 -> Q`` (a2000: two FP16 islands on codes) depends on one input code per
    element: dal.npu folds the whole chain into one 256-entry table step; on the a1000 each
    table activation (``DQ -> Sigmoid -> Mul -> Q``, ``DQ -> Mul -> Add -> Clip -> Mul -> Q``) is
    one. The tables equal the same file run node by node (``semantics="onnx"``) and the integer
    model on every element, in the layouts the session plans and with the float tensors."""
    import dal.npu
    torch.manual_seed(0)
    qat, proto, sess = build(ActNet(), torch.randn(SHAPE), hardware, recipe=_recipe(change))
    tables = [s for s in sess.steps if getattr(s, "kind", "") == "codes"]
    # a2000, 6 Casts: SiLU's two round trips, HardSwish's output one (its input is SiLU's fp16 output)
    assert [sum(n.op_type == "Cast" for n in t.chain) for t in tables] == casts, [s.node_name for s in tables]
    sess.run({sess.input_names[0]: torch.randn(SHAPE).numpy()})  # plans the layouts
    assert tables[0].nhwc_in == (True,), "the first table reads the conv group's pixel-major codes"
    nodes = dal.npu.load(proto, semantics="onnx", threads=1)
    q_outs = [n.output[0] for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    for x in random_batches(SHAPE, n=2, seed=13):
        feed = {sess.input_names[0]: x.numpy()}
        (y,), vals = sess.run(feed, return_intermediates=True)
        (y_ref,), ref = nodes.run(feed, return_intermediates=True)
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(sess.run(feed)[0], y_ref)  # pixel-major between the steps here
        for name in q_outs:
            np.testing.assert_array_equal(vals[name], ref[name], err_msg=name)
        for n in (n for t in tables for n in t.chain[1:]):  # the absorbed float tensors, when asked for
            np.testing.assert_array_equal(vals[n.output[0]], ref[n.output[0]], err_msg=n.name)
    assert_bit_exact(dal.convert(qat), proto, sess, random_batches(SHAPE, n=2, seed=17), f"ActNet/{hardware}")
