"""The graph-side cost model (an exported file) and the torch-side one (the prepared model) agree
row for row where the exporter writes one module as several nodes: RMSNorm's Pow / ReduceMean /
Add / Sqrt / Div / Mul, SiLU's Sigmoid + Mul, HardSwish's HardSigmoid + Mul (opset 13),
LayerNorm's decomposition and GELU's Erf form (below opset 17 / 20), an embedding's Gather.

The two sides are independent readings (modules + quantizers against nodes + element types);
the row counts per op class are also checked against the model's own modules. Cycles are
compared exactly: each row's cycles are the same roofline expression of the same integers,
and every value is a multiple of 1/8 well below 2**53, so their sums are exact in float64
whatever the order."""
import collections
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import onnx
import pytest
import torch
import torchvision
from onnx import TensorProto, helper
from torch import nn

import dal
from dal.cost import estimate
from dal.cost.onnx_graph import onnx_layers


def _rows(est):
    return collections.Counter((r.geom.op_class, r.geom.macs, r.geom.weight_elems, r.geom.input_elems,
                                r.geom.output_elems, r.choice.label if r.choice else None, r.cycles)
                               for r in est.rows)


def _per_class(est):
    out = collections.defaultdict(lambda: [0, 0.0])
    for r in est.rows:
        out[r.geom.op_class][0] += 1
        out[r.geom.op_class][1] += r.cycles
    return {k: tuple(v) for k, v in out.items()}


def _node_types(path):
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _both(q, x, path):
    dal.export_onnx(q, x, str(path))
    return estimate(q, example_inputs=x), estimate(path)


LAYERS, HIDDEN, SEQ = 2, 64, 16


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                         max_position_embeddings=128)).eval()
    ids = torch.randint(0, 256, (1, SEQ))
    q = dal.prepare_qat(m, recipe="w4a8_int8_llm", hardware="a2000")
    dal.calibrate(q, [ids, ids], progress=False)
    path = tmp_path_factory.mktemp("llama") / "llama.onnx"
    return (*_both(q, (ids,), path), path)


def test_tiny_llama_graph_and_model_agree_row_for_row(llama):
    a, b, path = llama
    types = _node_types(path)
    # the file writes each RMSNorm and SiLU as several nodes (5 norms, 2 SiLUs), the embedding as a Gather
    assert types["Sqrt"] == types["Pow"] == 2 * LAYERS + 1 and types["Sigmoid"] == LAYERS and types["Gather"] >= 1
    assert _rows(a) == _rows(b) and len(a.rows) == len(b.rows) == 61
    per_class = _per_class(b)
    assert per_class == _per_class(a)
    assert per_class["layernorm"][0] == 2 * LAYERS + 1 and per_class["activation"][0] == LAYERS
    assert per_class["embedding"][0] == 1
    for est in (a, b):
        norms = [r for r in est.rows if r.geom.op_class == "layernorm"]
        assert {(r.geom.input_elems, r.geom.output_elems, r.choice.label) for r in norms} == \
            {(SEQ * HIDDEN, SEQ * HIDDEN, "wfp16/afp16")}
        (emb,) = [r for r in est.rows if r.geom.op_class == "embedding"]
        assert (emb.geom.weight_elems, emb.geom.input_elems, emb.geom.output_elems) == (SEQ * HIDDEN, 0, SEQ * HIDDEN)
    assert a.total_cycles == b.total_cycles


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "resnet18"])
def test_torchvision_graph_and_model_agree_row_for_row(tmp_path, name):
    torch.manual_seed(0)
    m = getattr(torchvision.models, name)().eval()
    x = torch.randn(1, 3, 32, 32)
    q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    a, b = _both(q, (x,), tmp_path / "m.onnx")
    assert _rows(a) == _rows(b) and _per_class(a) == _per_class(b)
    assert a.total_cycles == b.total_cycles
    if name == "mobilenet_v3_small":  # opset 13: HardSwish is HardSigmoid + Mul; one activation each
        types = _node_types(tmp_path / "m.onnx")
        swish = sum(isinstance(mod, nn.Hardswish) for mod in m.modules())
        gates = sum(isinstance(mod, nn.Hardsigmoid) for mod in m.modules())
        assert types["HardSwish"] == 0 and types["HardSigmoid"] == swish + gates
        assert _per_class(b)["activation"][0] == swish + gates


class _NormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.act, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.norm(self.fc1(x))))


LN_FP16 = {"name": "ln_fp16", "replace": ["layernorm_fp16"], "rules": [
    {"type": ["conv", "linear"], "weight": {"format": "int8", "granularity": "per_channel", "symmetric": True},
     "input": {"format": "int8"}}]}


@pytest.mark.parametrize("recipe,norm_label", [("int8_balanced", "afp16"), (LN_FP16, "wfp16/afp16")])
def test_decomposed_layernorm_and_gelu_are_one_layer_each(tmp_path, recipe, norm_label):
    """A float LayerNorm, and ``Fp16LayerNorm`` (its weight an FP16 quantizer's Cast round trip
    in the file), each one layer in the formats the model's quantizers give."""
    torch.manual_seed(0)
    x = torch.randn(1, 4, 16)
    q = dal.prepare_qat(_NormGelu().eval(), recipe=recipe, hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    a, b = _both(q, (x,), tmp_path / "m.onnx")
    types = _node_types(tmp_path / "m.onnx")
    assert types["LayerNormalization"] == 0 and types["Erf"] == 1 and types["Sub"] == 1  # decomposed forms
    assert _rows(a) == _rows(b)
    assert sorted((r.geom.op_class, r.geom.input_elems, r.geom.output_elems) for r in b.rows
                  if r.geom.op_class in ("layernorm", "activation")) == [("activation", 128, 128), ("layernorm", 128, 128)]
    assert [r.choice.label for r in b.rows if r.geom.op_class == "layernorm"] == [norm_label]


def _graph_layers(tmp_path, nodes, extra_outputs=()):
    shape = [2, 8]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("y", *extra_outputs)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outs,
                              initializer=[helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    geoms, _, _ = onnx_layers(path)
    return [(g.op_class, g.function, g.input_elems, g.output_elems) for g in geoms]


def test_a_gate_is_one_activation_only_when_it_is_one(tmp_path):
    """``x * sigmoid(x)`` is one SiLU (16 elements in, 16 out); the same nodes with the Sigmoid
    also read elsewhere, and ``x * (x + 1)`` (no activation in it), stay separate layers."""
    silu = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    assert _graph_layers(tmp_path, silu) == [("activation", "silu", 16, 16)]
    assert _graph_layers(tmp_path, silu, extra_outputs=("s",)) == [("activation", "", 16, 16), ("mul", "", 32, 16)]
    square = [helper.make_node("Add", ["x", "one"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    assert _graph_layers(tmp_path, square) == [("add", "", 16, 16), ("mul", "", 32, 16)]


class _OwnGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y * torch.sigmoid(y)  # SiLU written as two calls


def test_a_gate_the_forward_writes_stays_two_layers(tmp_path):
    """``y * torch.sigmoid(y)`` in a forward: prepare makes the product a QMul, whose operands
    are quantized (the Mul reads two DequantizeLinears, not ``y`` and ``Sigmoid(y)``), so the
    file has no gate: a sigmoid and a mul on both sides, as the model's two calls."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    q = dal.prepare_qat(_OwnGate().eval(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    a, b = _both(q, (x,), tmp_path / "m.onnx")
    n = x.shape[0] * 4 * 8 * 8
    assert _rows(a) == _rows(b)
    assert [(r.geom.op_class, r.geom.input_elems, r.geom.output_elems) for r in b.rows][1:] == \
        [("activation", n, n), ("mul", 2 * n, n)]


class _ConvSilu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.act, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.conv2(self.act(self.conv1(x)))


LUT_RECIPE = {"name": "int8_lut", "replace": ["lut_activation"], "rules": [
    {"type": ["conv", "linear"], "weight": {"format": "int8", "granularity": "per_channel", "symmetric": True},
     "input": {"format": "int8"}},
    {"type": "activation", "input": {"format": "int8"}}]}


def test_a_lookup_table_activation_is_timed_as_a_lookup_on_both_sides(tmp_path):
    """``lut_activation`` on the a1000 (no fp16): the SiLU is ``QLutActivation``, exported
    ``DQ -> Mul(x, Sigmoid(x)) -> Q``; both sides time it at the lookup rate."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 8, 8)
    q = dal.prepare_qat(_ConvSilu().eval(), recipe=LUT_RECIPE, hardware="a1000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    a, b = _both(q, (x,), tmp_path / "m.onnx")
    assert _rows(a) == _rows(b)
    (act,) = [r for r in b.rows if r.geom.op_class == "activation"]
    assert act.choice.lut and (act.geom.function, act.geom.input_elems) == ("silu", 8 * 8 * 8)
