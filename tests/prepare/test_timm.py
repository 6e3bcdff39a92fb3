"""timm models (random weights, no download) through the whole flow: prepare, a QAT step,
export, verify on the a2000.

timm builds its networks from parts torchvision does not use: a zero-initialised last BN in each
residual block (gamma = 0, which made QConvBn2d's training step 0 / 0 = NaN), LayerNorm2d + GELU
(ConvNeXt), RepVGG's parallel branches, and ``BatchNormAct2d`` (a BatchNorm2d subclass with its
activation inside, which prepare used to fold whole, dropping the activation, and then failed on
with an AttributeError; now its BN folds and the activation stays: dal.nn.norm_act), and timm's
own ``Linear`` (MobileNetV3's classifier: listed as an unknown float module, so the exported
head was a float Gemm that the integer model and dal.npu summed in different orders; now the
QLinear of nn.Linear, whose computation it is: dal.nn.registry.EQUIVALENT_TYPES); MixNet's
mixed kernels and the ViT's qkv export a Split, which dal.npu now runs; DLA's block tests its
``shortcut=None`` argument, which torch.fx cannot trace faithfully (own_forward.trace_own_forward);
DenseNet's pre-activation BatchNormAct2d reads a Concat, nothing to fold into, and stayed a float
BN, which dal.convert ran in torch's float32 kernel (an ulp off dal.npu's one rounding on ~1/4 of
elements, 30135 codes differed end to end; then float64 rounded once, dal.convert.float_ops);
now its BN is a QBatchNorm2d like a plain unfolded BatchNorm2d (dal.nn.norm_act.NormActAffine),
which dal.convert computes as the integer group dal.npu runs (its float32 QAT forward had 9 codes
of one layer's 98304 off after the training step);
ResNeSt's split attention exports a float ReduceSum and its avg_down a ceil-mode AveragePool,
which dal.npu now runs and dal.convert computes by the same rule (float64 sums, rounded once);
HRNet's head calls ``down.forward(y)`` on a Conv-BN-ReLU Sequential (fx traced through it, and
the fusion was planned twice), SelecSLS's block tests ``isinstance(x, list)`` (fx passes a
Proxy: the traced block fed its list input to a conv). Each model must train finite and verify:
dal.convert == dal.npu on every element, <= 1 LSB layer by layer against onnxruntime.
"""
import pytest
import torch

import dal
from dal.prepare import set_quantizer_state

timm = pytest.importorskip("timm")  # a dev dependency (pyproject): present wherever make test runs

MODELS = ["resnet18", "efficientnet_b0", "mobilenetv3_small_100", "regnetx_002", "convnext_atto", "repvgg_a0",
          "mixnet_s", "vit_tiny_patch16_224", "dla34", "densenet121", "resnest14d", "hrnet_w18_small",
          "selecsls42b"]


def _float_model(name: str) -> torch.nn.Module:
    """``name`` from seed 0 with its BatchNorm statistics set from one random batch (cumulative),
    so that eval-mode activations are not the ~0 of random-init statistics."""
    torch.manual_seed(0)
    size = {"img_size": 64} if name.startswith("vit") else {}  # a ViT's position table is per image size
    m = timm.create_model(name, pretrained=False, num_classes=10, **size)
    norms = [b for b in m.modules() if isinstance(b, torch.nn.modules.batchnorm._BatchNorm)]
    for b in norms:
        b.reset_running_stats()
        b.momentum = None
    with torch.no_grad():
        m.train()(torch.randn(8, 3, 64, 64))
    for b in norms:
        b.momentum = 0.1
    return m.eval()


def _calibrate_and_step(q, size: int) -> None:
    """Calibrate ``q`` on two random batches of 4 x 3 x size x size, then one SGD step of a
    10-class cross entropy in train mode: the loss and every parameter stay finite."""
    dal.calibrate(q, [torch.randn(4, 3, size, size) for _ in range(2)], progress=False)
    q.train()
    opt = torch.optim.SGD(q.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(q(torch.randn(4, 3, size, size)), torch.randint(0, 10, (4,)))
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and all(torch.isfinite(p).all() for p in q.parameters()), "not finite after one step"


@pytest.mark.parametrize("name", MODELS)
def test_timm_model_trains_exports_and_verifies(name, tmp_path):
    m = _float_model(name)
    x = torch.randn(2, 3, 64, 64)
    q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    _calibrate_and_step(q, 64)
    set_quantizer_state(q, "frozen")
    q.eval()
    path = tmp_path / f"{name}.onnx"
    dal.export_onnx(q, (x,), path)
    report = dal.verify(path, q, (x,))
    differ, total, worst = report.layer_by_layer()
    assert report.integer.identical, report.integer
    assert total and worst <= 1 and report.verdict(), report.verdict_line()


def test_batchnorm_with_its_activation_inside_folds_and_keeps_the_activation():
    """EfficientNet's BatchNormAct2d (BN + SiLU in one module): the BN folds into the conv before
    it and the SiLU stays at its path (an FP16 island on the a2000). With every quantizer off the
    prepared model is the float one within float rounding (folding moves the rounding); before,
    prepare folded the whole module, dropping the SiLU, and then failed with an AttributeError."""
    m = _float_model("efficientnet_b0")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = m(x)
    names = [p for p, mod in m.named_modules() if type(mod).__name__ == "BatchNormAct2d"]
    acts = [p for p in names if not isinstance(m.get_submodule(p).act, torch.nn.Identity)]  # the rest: no act
    q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    assert names and not any(r.type_name == "BatchNormAct2d" for r in rows.values())
    assert rows["conv_stem"].type_name == "QConvBn2d" and "fused with bn1" in rows["conv_stem"].detail
    assert acts and all(rows[f"{p}.act"].status in ("fp16", "quantized") for p in acts)
    set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), want, rtol=1e-4, atol=1e-4)


def test_a_batchnorm_subclass_with_its_own_forward_is_never_folded():
    """Any other BatchNorm2d subclass that overrides forward may compute more than a BN: it is
    planned as the module it is (listed float, with the hardware's verdict), not folded."""
    class ScaledBN(torch.nn.BatchNorm2d):
        def forward(self, x):
            return 2.0 * super().forward(x)

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), ScaledBN(4)).eval()
    x = torch.randn(1, 3, 8, 8)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    assert rows["0"].type_name == "QConv2d" and rows["1"].status == "float", rows
    set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x))


class _UnfoldedNormActs(torch.nn.Module):
    """timm's BatchNormAct2d where no conv precedes it: at the model's input (BN + ReLU) and on a
    Concat, as DenseNet's pre-activation norms (BN + SiLU)."""

    def __init__(self):
        super().__init__()
        from timm.layers import BatchNormAct2d
        self.inp = BatchNormAct2d(3)
        self.a = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.b = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.norm = BatchNormAct2d(12, act_layer=torch.nn.SiLU)
        self.head = torch.nn.Conv2d(12, 10, 1)

    def forward(self, x):
        x = self.inp(x)
        y = self.norm(torch.cat([self.a(x), self.b(x)], 1))
        return self.head(y).mean((2, 3))


def test_a_batchnorm_act_with_no_conv_before_it_is_a_quantized_affine(tmp_path):
    """Such a norm-act module was left a float BN ("no QAT module"), which the a2000 cannot run;
    now its BN is the QBatchNorm2d a plain unfolded BatchNorm2d becomes (dal.nn.norm: a
    per-channel affine, exported as a depthwise 1x1 Conv) at ``<path>.bn``, its drop and act at
    their paths. Quantizers off: the float model within float rounding; one QAT step stays finite;
    exported, dal.convert == dal.npu on every element and <= 1 LSB layer by layer against
    onnxruntime (dal.verify)."""
    from dal.nn import QBatchNorm2d
    torch.manual_seed(0)
    m = _UnfoldedNormActs()
    with torch.no_grad():
        for bn in (m.inp, m.norm):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    m.eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = m(x)
    q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    for p in ("inp", "norm"):
        assert rows[p].type_name == "QBatchNorm2d" and rows[p].status == "quantized", rows[p]
        assert isinstance(q.get_submodule(f"{p}.bn"), QBatchNorm2d)
        assert torch.equal(q.get_submodule(f"{p}.bn").running_var, m.get_submodule(p).running_var)
    assert type(q.get_submodule("inp.act")) is torch.nn.ReLU and rows["norm.act"].status == "fp16"
    set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), want, rtol=1e-5, atol=1e-5)
    set_quantizer_state(q, "observe")
    _calibrate_and_step(q, 16)
    set_quantizer_state(q, "frozen")
    q.eval()
    path = tmp_path / "norm_acts.onnx"
    dal.export_onnx(q, (x,), path)
    import onnx
    nodes = onnx.load(str(path)).graph.node
    assert not any(n.op_type == "BatchNormalization" for n in nodes)
    groups = [next(a.i for a in n.attribute if a.name == "group") for n in nodes
              if n.op_type == "Conv" and any(a.name == "group" for a in n.attribute)]
    assert 3 in groups and 12 in groups, groups  # the two affines: depthwise 1x1 convs
    # dal.convert computes the affine as the NPU does: an integer group (exact accumulation and
    # the requantizer) where its output goes to quantizers (inp: the two convs), else a float island
    im = dal.convert(q, (x,))
    assert im.layer_forms()["inp.bn"] == "integer", im.layer_forms()
    report = dal.verify(path, q, (x,))
    differ, total, worst = report.layer_by_layer()
    assert report.integer.identical, report.integer
    assert total and worst <= 1 and report.verdict(), report.verdict_line()
