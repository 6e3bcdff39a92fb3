"""transformers' Conv1D (GPT-2) as a QAT linear (dal.nn.hf_conv1d.QConv1D)."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402

pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj, self.head = Conv1D(96, 64), Conv1D(64, 96), torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.c_proj(torch.relu(self.c_fc(x))))


def test_conv1d_is_a_quantized_linear():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 5, 64)
    want = net(x)
    p = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000")
    assert type(p.c_fc).__name__ == "QConv1D" and p.c_fc.weight is net.c_fc.weight
    with dal.quantizer_states(p, "off"):
        torch.testing.assert_close(p(x), want, rtol=0, atol=0)  # transformers' own Conv1D: the oracle
    dal.calibrate(p, [x], progress=False)
    q = p.c_fc.weight_quant
    assert tuple(q.scale.shape) == (96,)  # one scale per output feature: axis 1 of the [in, out] weight
    codes = (q(p.c_fc.weight) / q.scale.reshape(1, -1)).detach()
    assert float((codes - codes.round()).abs().max()) < 1e-3 and codes.abs().max() <= 128.001  # a grid per column
    p(x).sum().backward()
    assert torch.isfinite(net.c_fc.weight.grad).all()
    back = p.c_fc.to_float()
    assert type(back) is Conv1D and back.weight is net.c_fc.weight


def test_int4_groups_run_along_the_input_features():
    p = dal.prepare_qat(Net(), recipe="w4a8_int8_llm", hardware="a2000")
    g = p.c_proj.weight_quant.granularity  # weight [96 in, 64 out]: blocks of 32 along axis 0
    assert (g.axis, g.block_size) == (0, 32)
    bad = Net()
    bad.c_proj = Conv1D(64, 80)  # 80 inputs: no a2000 group size divides them
    bad.c_fc = Conv1D(80, 64)
    with pytest.raises(dal.recipe.RecipeError, match="c_proj \\(Conv1D\\): weight axis 0 80 is not divisible"):
        dal.prepare_qat(bad, recipe="w4a8_int8_llm", hardware="a2000")
