"""Reparameterisable branch blocks (timm's MobileOne / FastViT ``MobileOneBlock``) sum their
branches as ``scale_out + identity_out`` or ``out = scale_out; out += conv(x)``, where an absent
branch is the Python int 0. The TorchScript exporter's peephole pass drops ``x + 0`` (and
``x * 1``), so in the file the branch's Conv (or standalone BatchNorm) is read by its quantizer
directly: an integer group, which dal.npu forms from the file. The integer model must form the
same group (dal.convert.probe.exporter_drops): before, it ran these layers in float
("NPU fuses 1 of 1 calls, integer model 0 of 1" on FastViT-T8's stem and downsamples)."""
import io
import warnings

import onnx
import pytest
import torch
from timm.models import byobnet, fastvit
from torch import nn
from torch.overrides import TorchFunctionMode

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches
from dal.convert.probe import exporter_drops

torch.set_num_threads(1)

#: spellings of arithmetic with a constant on a layer's output; which of them leave a node is
#: decided below by torch's own TorchScript exporter, not by dal
SPELLINGS = {
    "x + 0": lambda x: x + 0, "0 + x": lambda x: 0 + x, "x - 0": lambda x: x - 0,
    "x * 1": lambda x: x * 1, "1 * x": lambda x: 1 * x, "x.add(0)": lambda x: x.add(0),
    "torch.add(x, 0)": lambda x: torch.add(x, 0), "x.add(0, alpha=1)": lambda x: x.add(0, alpha=1),
    "torch.sub(x, 0, alpha=1)": lambda x: torch.sub(x, 0, alpha=1), "x.subtract(0)": lambda x: x.subtract(0),
    "torch.multiply(x, 1)": lambda x: torch.multiply(x, 1), "x.mul(1)": lambda x: x.mul(1),
    "x + 0.0": lambda x: x + 0.0, "0.0 + x": lambda x: 0.0 + x, "x * 1.0": lambda x: x * 1.0,
    "x - 0.0": lambda x: x - 0.0, "x / 1": lambda x: x / 1, "x + 1": lambda x: x + 1, "0 - x": lambda x: 0 - x,
    "x.add(0, alpha=2)": lambda x: x.add(0, alpha=2), "x.add(0, alpha=1.0)": lambda x: x.add(0, alpha=1.0),
    "torch.sub(x, 0, alpha=3)": lambda x: torch.sub(x, 0, alpha=3), "x + zeros(())": lambda x: x + torch.zeros(()),
    "x.add_(0)": lambda x: x.add_(0), "x.mul_(1)": lambda x: x.mul_(1),
}


class _Net(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f, self.conv = f, nn.Conv2d(2, 2, 1)

    def forward(self, x):
        return self.f(self.conv(x)).relu()


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_exporter_drops_agrees_with_torch_exporter(spelling):
    """exporter_drops(call) == (torch.onnx.export, TorchScript as dal.export_onnx calls it,
    writes no node for the call): Conv -> Relu alone in the file."""
    f = SPELLINGS[spelling]
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Net(f), (torch.randn(1, 2, 4, 4),), buf, dynamo=False, opset_version=17,
                          do_constant_folding=True, training=torch.onnx.TrainingMode.EVAL)
    ops = [n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node]
    dropped = ops == ["Conv", "Relu"]
    assert dropped or ops[0] == "Conv" and len(ops) > 2, ops
    y = torch.randn(1, 2, 4, 4)
    with _Calls() as rec:
        f(y)
    func, args, kwargs = next(c for c in rec.calls if c[1] and c[1][0] is y)  # the call on y
    assert exporter_drops(func, args, kwargs) == dropped, (spelling, ops)


def _fastvit_stem():
    """FastViT's own stem (timm.models.fastvit.convolutional_stem, as in fastvit_t8): a
    stride-2 MobileOneBlock (conv_scale, no identity: ``scale_out + 0``), a depthwise one and a
    1x1 one (identity BatchNorm, no conv_scale: ``0 + identity_out``), then a small head."""
    return nn.Sequential(fastvit.convolutional_stem(3, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 5))


def _mobileone_stage():
    """mobileone_s0's block pair (timm.models.byobnet.MobileOneBlock): a depthwise 3x3 block with
    conv_scale and identity, and a 1x1 block with neither (``out = 0; out += conv_kxk[0](x)``),
    four kxk branches each, as mobileone_s0's stages."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                         byobnet.MobileOneBlock(8, 8, 3, group_size=1, num_conv_branches=4),
                         byobnet.MobileOneBlock(8, 16, 1, num_conv_branches=4),
                         byobnet.MobileOneBlock(16, 16, 3, stride=2, group_size=1, num_conv_branches=4),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


@pytest.mark.parametrize("make, branch_layers", [
    (_fastvit_stem, {"0.0.conv_scale.conv", "0.1.conv_scale.conv", "0.2.identity"}),
    (_mobileone_stage, {"2.conv_kxk.0.conv"}),
])
def test_branch_sums_with_int_zero_are_integer_groups(make, branch_layers):
    """Integer model == dal.npu on every output element and every code of the file, with the
    same integer groups layer by layer; the branches summed with the int 0 are among them."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    qat, proto, sess = build(make().eval(), x, "a2000")
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches((2, 3, 32, 32), n=2), make.__name__)
    forms = im.layer_forms()
    assert {p: forms[p] for p in branch_layers} == {p: "integer" for p in branch_layers}, im.summary()
    assert sum(f == "integer" for f in forms.values()) == npu_fused_groups(sess)
