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
DenseNet's pre-activation BatchNormAct2d reads a Concat, nothing to fold into, and stays a float
BN, which dal.convert ran in torch's float32 kernel (an ulp off dal.npu's one rounding on ~1/4 of
elements, 30135 codes differed end to end; now float64 rounded once, dal.convert.float_ops);
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


@pytest.mark.parametrize("name", MODELS)
def test_timm_model_trains_exports_and_verifies(name, tmp_path):
    m = _float_model(name)
    x = torch.randn(2, 3, 64, 64)
    q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [torch.randn(4, 3, 64, 64) for _ in range(2)], progress=False)
    q.train()
    opt = torch.optim.SGD(q.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(q(torch.randn(4, 3, 64, 64)), torch.randint(0, 10, (4,)))
    loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in q.parameters()), "a parameter is not finite after one step"
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
