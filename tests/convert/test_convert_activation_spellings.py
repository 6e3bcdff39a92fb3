"""Every way a model spells ReLU / ReLU6 between two convolutions, in place or not: the exporter
writes one Clip (or Relu) and dal.npu fuses ``DQ -> Conv -> Clip -> Q`` into an integer group, so
dal.convert must read the same bounds from the torch call and fuse the layer too. A layer it
leaves in float instead rounds twice (float32 conv, then + bias) and lands one code off dal.npu
at a near-tie: SSDlite's heads did, 1 code in 13 M, when its ``nn.ReLU6(inplace=True)`` was read
as ``F.hardtanh_``."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches

torch.set_num_threads(1)
SHAPE = (2, 3, 12, 12)

SPELLINGS = {
    "nn.ReLU6(inplace=True)": nn.ReLU6(inplace=True),
    "nn.ReLU(inplace=True)": nn.ReLU(inplace=True),
    "F.hardtanh_": lambda y: F.hardtanh_(y, 0.0, 6.0),
    "F.relu6(inplace=True)": lambda y: F.relu6(y, inplace=True),
    "F.hardtanh(inplace=True)": lambda y: F.hardtanh(y, 0.0, 6.0, inplace=True),
    "Tensor.clamp_": lambda y: y.clamp_(0.0, 6.0),
    "Tensor.clip_": lambda y: y.clip_(0.0, 6.0),
    "torch.relu_": torch.relu_,
    "F.relu(inplace=True)": lambda y: F.relu(y, inplace=True),
}


class TwoConvs(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.act = act if isinstance(act, nn.Module) else None
        self.fn = None if isinstance(act, nn.Module) else act

    def forward(self, x):
        y = self.conv1(x)
        y = self.act(y) if self.act is not None else self.fn(y)
        return self.conv2(y)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_spelling_of_the_activation_is_one_integer_group_as_in_dal_npu(spelling):
    torch.manual_seed(0)
    qat, proto, sess = build(TwoConvs(SPELLINGS[spelling]), torch.randn(SHAPE) * 2, "a2000")
    assert {"Clip", "Relu"} & {n.op_type for n in proto.graph.node}
    assert npu_fused_groups(sess) == 2  # conv1 with its Clip / Relu, and conv2
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches(SHAPE, n=3, seed=5, scale=2.0), spelling)
    assert set(im.layer_forms().values()) == {"integer"}, im.layer_forms()


def test_dal_verify_names_a_layer_fused_on_one_side_only_though_every_code_agrees(monkeypatch):
    """The old probe (no F.hardtanh_): conv1 in float in the integer model, fused in dal.npu. On
    these inputs no near-tie flips a code, so only the group comparison can tell."""
    from dal.convert import probe
    monkeypatch.setattr(probe, "_ACT", {f: k for f, k in probe._ACT.items() if f is not F.hardtanh_})
    torch.manual_seed(0)
    qat, proto, sess = build(TwoConvs(SPELLINGS["F.hardtanh_"]), torch.randn(SHAPE) * 2, "a2000")
    row = dal.verify(proto, qat, (torch.randn(SHAPE),), onnxruntime=False).integer
    assert row.codes_differ == 0 and row.differ == 0 and not row.identical
    assert row.groups_differ == ("conv1.weight_quant: NPU fuses 1 of 1 calls, integer model 0 of 1",)
    assert "an integer group on one side only" in str(row)
