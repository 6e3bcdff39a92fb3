"""layernorm_fp16, upsample_nearest and conv_bn_relu (report only)."""
import torch
from torch import nn

import dal
from dal.prepare.state import set_quantizer_state
from dal.replace import Fp16LayerNorm, auto_replace

from oracles import run_ort
from replace_common import rel_err


def test_layernorm_fp16_float_equal_then_fp16():
    torch.manual_seed(0)
    ln = nn.LayerNorm(16)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    m = nn.Sequential(ln)
    x = torch.randn(4, 16) * 3
    ref = ln(x)
    auto_replace(m, ["layernorm_fp16"], "a2000")
    new = m[0]
    assert isinstance(new, Fp16LayerNorm) and new.weight is ln.weight and new.bias is ln.bias
    assert rel_err(new(x), ref) < 1e-6  # quantizers observe: identity
    set_quantizer_state(new, "quantize")
    y = new(x)
    expected = torch.nn.functional.layer_norm(x.half().float(), (16,), ln.weight.half().float(),
                                              ln.bias.half().float()).half().float()
    assert torch.equal(y, expected)
    assert type(new.to_float()) is nn.LayerNorm and new.to_float().weight is ln.weight


def test_layernorm_fp16_exports_with_casts(tmp_path):
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(16))
    auto_replace(m, ["layernorm_fp16"])
    set_quantizer_state(m, "frozen")
    x = torch.randn(3, 16)
    proto = dal.export_onnx(m, (x,), str(tmp_path / "ln.onnx"))
    assert "Cast" in {n.op_type for n in proto.graph.node}
    out = run_ort(str(tmp_path / "ln.onnx"), {"input": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(out), m(x))


def test_layernorm_not_replaced_where_hardware_has_no_fp16():
    m = nn.Sequential(nn.LayerNorm(4))
    rep = auto_replace(m, ["layernorm_fp16"], "a1000")
    assert type(m[0]) is nn.LayerNorm and "fp16" in rep.unmatched["layernorm_fp16"]


def test_upsample_bilinear_to_nearest_on_a1000():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Upsample(scale_factor=2, mode="bilinear"), nn.UpsamplingBilinear2d(scale_factor=2))
    x = torch.randn(1, 3, 8, 8)
    rep = auto_replace(m, ["upsample_nearest"], "a1000", (x,))
    assert [u.mode for u in (m[1], m[2])] == ["nearest", "nearest"]
    assert len(rep.replacements) == 2 and all(r.cosine is not None and r.cosine < 1 for r in rep.replacements)


def test_conv_bn_relu_reports_fusable_chains_and_changes_nothing():
    import torchvision

    m = torchvision.models.resnet18(weights=None)
    before = dict(m.named_modules())
    rep = auto_replace(m, ["conv_bn_relu", "lut_activation"])
    assert dict(m.named_modules()).keys() == before.keys()
    rows = {r.path: r for r in rep.by_rule("conv_bn_relu")}
    assert "conv1+bn1+relu" in rows[""].detail and rows["layer1.0"].noted_only
    assert "noted" in rep.summary()


class _SharedConv(nn.Module):
    """conv_a feeds BN once (fusable); conv_b is called twice (prepare must not fuse it)."""

    def __init__(self):
        super().__init__()
        self.conv_a, self.bn_a = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv_b, self.bn_b = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = torch.relu(self.bn_a(self.conv_a(x)))
        return self.bn_b(self.conv_b(y)) + self.conv_b(y)


def test_conv_bn_relu_lists_exactly_what_prepare_fuses():
    import dal

    m = _SharedConv()
    rep = auto_replace(m, ["conv_bn_relu"])
    (row,) = rep.by_rule("conv_bn_relu")
    assert row.detail.endswith("conv_a+bn_a+relu")  # not conv_b: called twice
    q = dal.prepare_qat(_SharedConv(), "int8_balanced", hardware="a2000", example_inputs=(torch.randn(1, 3, 8, 8),))
    kinds = {name: type(mod).__name__ for name, mod in q.named_modules()}
    assert kinds["conv_a"] == "QConvBnReLU2d" and kinds["conv_b"] == "QConv2d"
