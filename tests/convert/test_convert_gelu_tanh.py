"""GELU's tanh form (``approximate="tanh"``) in the integer model: through dal.replace's lookup
table (``lut_activation``) and as a float ``nn.GELU``, both computed as the exported nodes are
(export/SPEC.md §5a: torch's decomposition below opset 20, one ``Gelu`` node from 20), bit-exact
with dal.npu; the table's function checked against onnxruntime and a float64 oracle."""
import io
import math

import numpy as np
import onnx
import pytest
import torch
import yaml
from torch import nn

import dal
import dal.npu
from convert_common import assert_bit_exact, build, random_batches
from dal.convert.lut import gelu_onnx, onnx_function
from oracles import run_ort

torch.set_num_threads(1)
SHAPE = (3, 16, 24)


class TanhGeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(24, 48), nn.GELU(approximate="tanh"), nn.Linear(48, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _recipe(rules):
    rec = yaml.safe_load(open(dal.recipe.load.__file__.rsplit("/dal/", 1)[0] + "/recipes/int8_balanced.yaml"))
    rec["name"], rec["replace"] = "int8_balanced+rules", list(rules)
    return rec


@pytest.mark.parametrize("rules,form", [(["lut_activation"], "LutForm"), ([], "GeluForm")], ids=["table", "float"])
def test_tanh_gelu_bit_exact(rules, form):
    qat, proto, sess = build(TanhGeluMLP(), torch.randn(SHAPE), "a2000", recipe=_recipe(rules))
    kinds = {type(m).__name__ for m in qat.modules()}
    assert ("QLutActivation" in kinds) == bool(rules), kinds
    assert "Tanh" in {n.op_type for n in proto.graph.node}  # the decomposition, opset < 20
    im = dal.convert(qat)
    # inputs wide enough to reach both tails of the function (and the table's extreme codes)
    assert_bit_exact(im, proto, sess, random_batches(SHAPE, n=3, scale=3.0), f"tanh gelu {form}")
    assert set(im.forms.values()) == {form}, im.forms
    assert "QAT module" not in im.summary(), im.summary()


def _exported_gelu(opset: int, n: int) -> onnx.ModelProto:
    f = io.BytesIO()
    torch.onnx.export(nn.GELU(approximate="tanh"), (torch.randn(n),), f, dynamo=False, opset_version=opset,
                      input_names=["x"], output_names=["y"])
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("opset", [17, 20])
def test_the_table_function_is_the_exported_graph(opset):
    """On 2^16 float32 values: identical to dal.npu running the exported GELU (the other integer
    engine, node by node) and to the torch form (a float nn.GELU); within 2 float32 ulps of
    onnxruntime and of GELU-tanh in float64, plus |x| 2^-22 absolute: where tanh(u) ~ -1 the
    float32 ``1 + Tanh`` of the decomposition cancels (an error of ~|x| 2^-24, in every runtime)."""
    g = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-8, 8, 1 << 15, dtype=np.float32),
                        g.standard_normal(1 << 15).astype(np.float32) * 3])
    mine = onnx_function("gelu", x, "tanh", opset)
    proto = _exported_gelu(opset, x.size)
    assert ("Gelu" in {n.op_type for n in proto.graph.node}) == (opset >= 20)
    npu = dal.npu.run(proto, {"x": x})[0]
    np.testing.assert_array_equal(mine, npu)
    np.testing.assert_array_equal(gelu_onnx(torch.from_numpy(x), opset, "tanh").numpy(), mine)
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    for ref in (run_ort(proto, {"x": x})[0].astype(np.float64), exact):
        err = np.abs(mine.astype(np.float64) - ref)
        assert np.all(err <= 2 * np.spacing(np.abs(ref).astype(np.float32)) + np.abs(x64) * 2.0 ** -22), err.max()
