"""A frozen BatchNorm (torchvision's FrozenBatchNorm2d, Hugging Face's copies), recognised by what it
computes, folds into the conv before it as an eval-mode BatchNorm with frozen statistics
(dal.nn.frozen_bn, dal.nn.conv_frozen_bn), instead of becoming a quantized mul and add.

Oracles: the float64 frozen-BN formula ``x * w / sqrt(rv + eps) + (b - rm * w / sqrt(rv + eps))``
written here, torch's float64 conv2d, onnxruntime (ORT_DISABLE_ALL) and dal.npu through dal.verify.
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.nn.conv_frozen_bn import QConvFrozenBn2d
from dal.nn.frozen_bn import frozen_batchnorm_eps
from dal.prepare import set_quantizer_state

os.environ["HF_HUB_OFFLINE"] = "1"
torchvision = pytest.importorskip("torchvision")
FrozenBN = torchvision.ops.FrozenBatchNorm2d
F32_EPS = torch.finfo(torch.float32).eps


def _randomise(bn: nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        c = bn.weight.numel()
        bn.weight.copy_(torch.rand(c, generator=g) + 0.5)
        bn.bias.copy_(torch.rand(c, generator=g) * 0.4 - 0.2)
        bn.running_mean.copy_(torch.rand(c, generator=g) - 0.5)
        bn.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)


def _fold64(w: torch.Tensor, bn: nn.Module, eps: float, conv_bias=None):
    """The float64 fold: (W * f, beta + (b - mean) * f), f = gamma / sqrt(var + eps)."""
    f = bn.weight.double() / torch.sqrt(bn.running_var.double() + eps)
    b = torch.zeros_like(f) if conv_bias is None else conv_bias.detach().double()
    return w.detach().double() * f.reshape(-1, 1, 1, 1), bn.bias.double() + (b - bn.running_mean.double()) * f


def _rows(q):
    return {r.name: r for r in dal.prepared(q).report.rows}


@pytest.fixture(scope="module")
def resnet():
    """torchvision's resnet18 with FrozenBatchNorm2d (random buffers), prepared for the a2000."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m = torchvision.models.resnet18(norm_layer=FrozenBN, num_classes=10).eval()
    for b in m.modules():
        if isinstance(b, FrozenBN):
            _randomise(b, g)
    x = torch.randn(2, 3, 32, 32)
    q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    return m, q, x


@pytest.fixture(scope="module")
def trained(resnet):
    """The prepared resnet calibrated on x and one batch more, one SGD step in train mode, then
    quantizers frozen, eval; with the frozen BNs' buffers from before the step."""
    _, q, x = resnet
    q = copy.deepcopy(q)
    buffers = {k: v.clone() for k, v in q.state_dict().items() if ".bn." in k}
    set_quantizer_state(q, "observe")
    dal.calibrate(q, [x, torch.randn(2, 3, 32, 32)], progress=False)
    q.train()
    weight = q.conv1.weight.detach().clone()
    opt = torch.optim.SGD(q.parameters(), lr=1e-2)
    F.cross_entropy(q(torch.randn(4, 3, 32, 32)), torch.arange(4)).backward()
    opt.step()
    set_quantizer_state(q, "frozen")
    return q.eval(), x, buffers, weight


def test_resnet18_frozen_bns_fold_into_their_convs(resnet):
    """Every conv + FrozenBatchNorm2d (+ ReLU) of resnet18 is one folded layer in the report, no
    bn.mul / bn.add rows remain, and with every quantizer off the prepared model is the float one
    within float32 rounding (the fold moves the rounding)."""
    m, q, x = resnet
    rows = _rows(q)
    bns = [p for p, mod in m.named_modules() if isinstance(mod, FrozenBN)]
    folded = [r for r in rows.values() if r.type_name.startswith("QConvFrozenBn")]
    assert len(bns) == 20 and len(folded) == 20, [r.type_name for r in rows.values()]
    assert rows["conv1"].type_name == "QConvFrozenBnReLU2d" and "fused with bn1" in rows["conv1"].detail
    assert rows["layer1.0.conv2"].type_name == "QConvFrozenBn2d"
    assert rows["layer2.0.downsample.0"].type_name == "QConvFrozenBn2d"
    assert not [n for n in rows if n.split(".")[-1] in ("mul", "add") and ".bn" in n], sorted(rows)
    kept = {id(f.bn) for f in q.modules() if isinstance(f, QConvFrozenBn2d)}
    assert all(id(mod) in kept for mod in q.modules() if isinstance(mod, FrozenBN))  # only inside the folds
    off = copy.deepcopy(q)
    set_quantizer_state(off, "off")
    with torch.no_grad():
        torch.testing.assert_close(off(x), m(x))


def test_folded_weight_and_bias_are_the_float64_fold(resnet):
    """Each folded layer's float weight and bias (what its weight quantizer sees) equal the float64
    fold of the conv and the frozen BN (eps = torchvision's 1e-5) within 2 float32 roundings."""
    _, q, _ = resnet
    layers = [mod for mod in q.modules() if isinstance(mod, QConvFrozenBn2d)]
    assert len(layers) == 20
    for mod in layers:
        w32, b32 = mod.folded_weight_and_bias()
        w64, b64 = _fold64(mod.weight, mod.bn, mod.bn.eps, mod.bias)
        assert ((w32.double() - w64).abs() <= 2 * F32_EPS * w64.abs()).all()
        f64 = mod.bn.weight.double() / torch.sqrt(mod.bn.running_var.double() + mod.bn.eps)
        bias_mag = mod.bn.bias.double().abs() + (mod.bn.running_mean.double() * f64).abs()
        assert ((b32.double() - b64).abs() <= 2 * F32_EPS * bias_mag).all()


def test_qat_step_keeps_the_frozen_statistics_and_trains_the_conv(trained):
    """A QAT step in train mode leaves every frozen BN buffer as it was (no statistics update, no
    parameters), and trains the conv weight; the BN stays frozen after dal.freeze_bn(False)."""
    q, _, buffers, weight = trained
    state = q.state_dict()
    assert len(buffers) == 80 and all(torch.equal(v, state[k]) for k, v in buffers.items())
    assert not torch.equal(weight, q.conv1.weight)
    dal.freeze_bn(q, False)
    assert all(m._bn_is_frozen() for m in q.modules() if isinstance(m, QConvFrozenBn2d))


def test_quantized_weights_are_the_float64_fold_rounded(trained):
    """Every folded layer's quantized weight, in codes of its weight quantizer's scale, is the
    float64 fold rounded half to even and clipped to the format's codes, except on near-ties
    (within 1e-4 of a half), by 1 code."""
    q = trained[0]
    for mod in (m for m in q.modules() if isinstance(m, QConvFrozenBn2d)):
        s = mod.weight_quant.scale.detach().double().reshape(-1, 1, 1, 1)
        with torch.no_grad():
            codes = mod.quantized_weight(mod.folded_weight_and_bias()[0]).double() / s
        w64 = _fold64(mod.weight, mod.bn, mod.bn.eps, mod.bias)[0] / s
        want = torch.clamp(torch.round(w64), mod.weight_quant.qmin, mod.weight_quant.qmax)
        differ = (codes - want).abs() > 1e-3
        assert (codes - want).abs().max() <= 1 + 1e-3
        assert ((w64[differ] - w64[differ].floor() - 0.5).abs() < 1e-4).all()


def test_qat_forward_is_within_the_quantization_bound_of_the_float_layer(trained):
    """conv1 + frozen bn1 + relu of the trained resnet: the QAT output differs from the float64
    layer (the conv's float weight, the frozen-BN formula, relu) by at most the input-, weight- and
    bias-quantization errors carried through the conv in float64, plus float32 accumulation
    (K * eps of the sum of |products|, K the fan-in). In LSBs of the grid the chip stores that
    output on (layer1.0.conv1's input quantizer, after the max pool), that bound is < 16 LSB."""
    q, x, _, _ = trained
    mod = q.conv1
    assert mod.output_quant is None  # quantized by its consumer's input quantizer
    with torch.no_grad():
        y = mod(x).double()
        xq = mod.input_quant(x).double()
        w64, b64 = _fold64(mod.weight, mod.bn, mod.bn.eps, mod.bias)
        w32, b32 = mod.folded_weight_and_bias()
        wq, bq = mod.quantized_weight(w32).double(), mod.quantized_bias(b32).double()
        conv = dict(stride=mod.stride, padding=mod.padding)
        x64 = x.double()
        ref = torch.relu(F.conv2d(x64, w64, b64, **conv))
        carried = F.conv2d((x64 - xq).abs(), w64.abs(), **conv) + F.conv2d(xq.abs(), (wq - w64).abs(), **conv) \
            + (bq - b64).abs().reshape(1, -1, 1, 1)
        fan_in = wq[0].numel()
        rounding = fan_in * F32_EPS * (F.conv2d(xq.abs(), wq.abs(), **conv) + bq.abs().reshape(1, -1, 1, 1))
    lsb = q.layer1[0].conv1.input_quant.scale.double()
    assert ((y - ref).abs() <= carried + rounding).all(), float(((y - ref).abs() - carried - rounding).max() / lsb)
    # not a blank cheque: the worst-case carried error (~10 LSB here; the largest actual one ~2)
    # stays well inside the output's range (~256 LSB)
    assert float((carried / lsb).max()) < 16 and float(ref.max() / lsb) > 128


def test_export_has_no_mul_or_add_after_a_conv_and_verifies(trained, tmp_path):
    """Exported, every conv's output goes to a Relu or a QuantizeLinear (no Mul / Add of the BN
    after it; the only Adds are resnet's 8 residual adds); dal.convert == dal.npu on every
    element and <= 1 LSB (near-ties only) layer by layer against onnxruntime (dal.verify)."""
    import onnx
    q, x, _, _ = trained
    path = tmp_path / "resnet18_frozen.onnx"
    dal.export_onnx(q, (x[:1],), path)
    nodes = onnx.load(str(path)).graph.node
    convs = [n for n in nodes if n.op_type == "Conv"]
    after = {n.op_type for c in convs for n in nodes if set(c.output) & set(n.input)}
    assert len(convs) == 20 and after <= {"Relu", "QuantizeLinear"}, after
    assert not any(n.op_type == "Mul" for n in nodes) and sum(n.op_type == "Add" for n in nodes) == 8
    report = dal.verify(path, q, (x[:1],))
    differ, total, worst = report.layer_by_layer()
    assert report.integer.identical, report.integer
    assert total and worst <= 1 and report.verdict(), report.verdict_line()


class _VarianceNotStd(nn.Module):
    """FrozenBatchNorm2d's buffers and eps, but divides by the variance, not its square root."""

    def __init__(self, n: int):
        super().__init__()
        self.eps = 1e-5
        for name, v in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((n,), v))

    def forward(self, x):
        scale = (self.weight / (self.running_var + self.eps)).reshape(1, -1, 1, 1)
        return x * scale + (self.bias - self.running_mean * scale.flatten()).reshape(1, -1, 1, 1)


class _ReluInside(FrozenBN):
    """FrozenBatchNorm2d's affine with a ReLU inside its forward."""

    def forward(self, x):
        return torch.relu(super().forward(x))


class _UpdatesMean(FrozenBN):
    """FrozenBatchNorm2d's affine, then moves its running mean (a statistic update on every call)."""

    def forward(self, x):
        y = super().forward(x)
        self.running_mean.add_(1.0)
        return y


@pytest.mark.parametrize("cls", [_VarianceNotStd, _ReluInside, _UpdatesMean])
def test_a_look_alike_with_another_forward_is_not_folded(cls):
    """Same buffers (and eps), another forward: not recognised, so the conv stays a QConv2d and the
    module is planned as today; recognising it ran its forward on a copy (the buffers unchanged)."""
    g = torch.Generator().manual_seed(2)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), cls(4)).eval()
    _randomise(net[1], g)
    twin = FrozenBN(4)
    twin.load_state_dict(net[1].state_dict())
    assert frozen_batchnorm_eps(twin) == 1e-5
    mean = net[1].running_mean.clone()
    assert frozen_batchnorm_eps(net[1]) is None
    assert torch.equal(net[1].running_mean, mean)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(torch.randn(1, 3, 8, 8),),
                        inplace=False)
    assert _rows(q)["0"].type_name == "QConv2d"
    assert not any(isinstance(m, QConvFrozenBn2d) for m in q.modules())


class _ConvReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), FrozenBN(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


@pytest.mark.parametrize("net, bn", [(lambda: nn.Sequential(nn.MaxPool2d(2), FrozenBN(3)), "1"), (_ConvReadTwice, "bn")],
                         ids=["no-conv-before", "conv-read-twice"])
def test_without_a_conv_of_its_own_before_it_the_frozen_bn_stays(net, bn):
    """No conv before it, or a conv whose output another op also reads: not folded, its forward's
    multiply and add quantized as before."""
    net = net().eval()
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(torch.randn(1, 3, 8, 8),),
                        inplace=False)
    rows = _rows(q)
    assert not any(isinstance(m, QConvFrozenBn2d) for m in q.modules())
    assert rows[f"{bn}.mul"].type_name == "QMul" and rows[f"{bn}.add"].type_name == "QAdd", sorted(rows)


def test_hugging_face_frozen_batchnorm_folds(tmp_path):
    """transformers' DeformableDetrFrozenBatchNorm2d (eps 1e-5 written inside its forward, no eps
    attribute) after a conv folds like torchvision's: its eps found by the probe, the folded weight
    the float64 fold, quantizers off the float model; exported, it verifies."""
    pytest.importorskip("transformers")
    from transformers.models.deformable_detr.modeling_deformable_detr import DeformableDetrFrozenBatchNorm2d as HFBN
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), HFBN(8), nn.ReLU(), nn.Conv2d(8, 8, 3), HFBN(8)).eval()
    for b in (net[1], net[4]):
        _randomise(b, g)
    assert not hasattr(net[1], "eps") and frozen_batchnorm_eps(net[1]) == 1e-5
    x = torch.randn(2, 3, 12, 12)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    rows = _rows(q)
    assert rows["0"].type_name == "QConvFrozenBnReLU2d" and rows["3"].type_name == "QConvFrozenBn2d", rows
    for p in ("0", "3"):
        w32 = q.get_submodule(p).folded_weight_and_bias()[0]
        w64 = _fold64(q.get_submodule(p).weight, q.get_submodule(f"{p}.bn"), 1e-5)[0]
        assert ((w32.double() - w64).abs() <= 2 * F32_EPS * w64.abs()).all()
    set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x))
    set_quantizer_state(q, "observe")
    dal.calibrate(q, [x], progress=False)
    set_quantizer_state(q, "frozen")
    path = tmp_path / "hf_frozen.onnx"
    dal.export_onnx(q.eval(), (x[:1],), path)
    report = dal.verify(path, q, (x[:1],))
    assert report.integer.identical and report.verdict(), report.verdict_line()


def test_checkpoint_to_float_and_bias_correction_of_a_folded_frozen_bn():
    """prepare_qat + load_state_dict restores the folded model exactly; dal.prepare.to_float gives
    back conv + FrozenBatchNorm2d (+ ReLU), the float model exactly; dal.ptq.bias_correction moves
    the frozen BN's bias (the folded bias) and never its statistics."""
    from dal.prepare import to_float
    from dal.ptq.bias import bias_correction
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), FrozenBN(8), nn.ReLU(), nn.Conv2d(8, 8, 3), FrozenBN(8)).eval()
    for b in (net[1], net[4]):
        _randomise(b, g)
    x = torch.randn(2, 3, 12, 12)

    def prepare():
        return dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))

    q, q2 = prepare(), prepare()
    dal.calibrate(q, [x], progress=False)
    q2.load_state_dict(q.state_dict())
    set_quantizer_state(q, "frozen")
    set_quantizer_state(q2, "frozen")
    with torch.no_grad():
        assert torch.equal(q(x), q2(x))
        back = to_float(copy.deepcopy(q))
        assert isinstance(back.get_submodule("0.1"), FrozenBN) and isinstance(back.get_submodule("3.1"), FrozenBN)
        assert torch.equal(back(x), net(x))
    stats = {k: v.clone() for k, v in q.state_dict().items() if k.endswith(("running_mean", "running_var"))}
    bias = q.get_submodule("3.bn").bias.clone()
    bias_correction(q, [x], progress=False)
    assert len(stats) == 4 and all(torch.equal(v, q.state_dict()[k]) for k, v in stats.items())
    assert not torch.equal(bias, q.get_submodule("3.bn").bias)


def test_recognition_finds_the_eps_each_frozen_bn_computes_with():
    """With random buffers: torchvision's FrozenBatchNorm2d(eps=1e-3) computes with 1e-3, and with 0.1
    once its eps attribute is set to that; timm's freeze_batch_norm_2d of a BatchNorm2d(eps=1e-3)
    (torchvision's class, eps copied) with 1e-3. Not recognised: a BatchNorm2d (parameters), a
    module without the four buffers, timm's FrozenBatchNormAct2d (its activation inside: submodules)."""
    g = torch.Generator().manual_seed(5)
    tv = FrozenBN(6, eps=1e-3)
    _randomise(tv, g)
    assert frozen_batchnorm_eps(tv) == 1e-3
    tv.eps = 0.1
    assert frozen_batchnorm_eps(tv) == 0.1
    assert frozen_batchnorm_eps(nn.BatchNorm2d(6).eval()) is None
    assert frozen_batchnorm_eps(nn.Identity()) is None
    timm = pytest.importorskip("timm")
    frozen = timm.layers.freeze_batch_norm_2d(nn.BatchNorm2d(6, eps=1e-3))
    _randomise(frozen, g)
    assert frozen_batchnorm_eps(frozen) == 1e-3
    act = timm.layers.freeze_batch_norm_2d(timm.layers.BatchNormAct2d(6, act_layer=nn.ReLU))
    assert type(act).__name__ == "FrozenBatchNormAct2d" and frozen_batchnorm_eps(act) is None
