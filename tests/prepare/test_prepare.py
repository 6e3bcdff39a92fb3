"""prepare_qat on real torchvision models and bundled recipes."""
import copy

import pytest
import torch
import torchvision
from torch import nn

import dal
from dal.prepare import set_quantizer_state
from dal_examples.zoo import MnistCNN

RECIPES = ["int8_balanced", "w4a8_fp8_performance", "int8_sparse24", "fp16_precision"]
CLASSIFIERS = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (1, 3, 64, 64)),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(weights=None), (1, 3, 64, 64)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(weights=None), (1, 3, 64, 64)),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(weights=None), (1, 3, 64, 64)),
    "shufflenet_v2_x0_5": (lambda: torchvision.models.shufflenet_v2_x0_5(weights=None), (1, 3, 64, 64)),
    "vit_b_16": (lambda: torchvision.models.vit_b_16(weights=None), (1, 3, 224, 224)),
    "swin_t": (lambda: torchvision.models.swin_t(weights=None), (1, 3, 64, 64)),
}


@pytest.fixture(scope="module")
def float_models():
    torch.manual_seed(0)
    return {name: make().eval() for name, (make, _) in CLASSIFIERS.items()}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_torchvision_models_prepare_with_every_recipe(float_models, name, recipe):
    model = float_models[name]
    q = dal.prepare_qat(model, recipe=recipe, hardware="a2000", inplace=False)
    report = dal.prepared(q).report
    leaves_with_weights = {n for n, m in model.named_modules()
                           if isinstance(m, (nn.Conv2d, nn.Linear)) and not n.endswith("out_proj")}
    reported = {r.name for r in report.rows}
    # Every conv / linear appears in the report: quantized, fused (reported under the conv name) or float.
    missing = {n for n in leaves_with_weights if n not in reported}
    assert not missing, f"{name}/{recipe}: layers missing from the report: {sorted(missing)[:5]}"
    assert report.quantized, f"{name}/{recipe}: nothing was quantized"


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_prepared_model_runs_and_equals_float_with_quantizers_off(float_models, name):
    model = float_models[name]
    shape = CLASSIFIERS[name][1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    with torch.no_grad():
        ref = model(x)
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", inplace=False, example_inputs=(x,))
    q.eval()
    set_quantizer_state(q, "off")
    with torch.no_grad():
        off = q(x)
    # BN folding reorders float operations: equal within float rounding.
    torch.testing.assert_close(off, ref, rtol=1e-4, atol=1e-4)
    dal.calibrate(q, [torch.randn(shape, generator=g)], progress=False)
    with torch.no_grad():
        out = q(x)
    assert out.shape == ref.shape and torch.isfinite(out).all()


def test_fcos_untraceable_model_prepares_without_crashing():
    torch.manual_seed(0)
    model = torchvision.models.detection.fcos_resnet50_fpn(weights=None, weights_backbone=None).eval()
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000")
    report = dal.prepared(q).report
    assert any("does not trace" in n for n in report.notes)
    assert len(report.quantized) > 50
    set_quantizer_state(q, "off")
    with torch.no_grad():
        out = q([torch.rand(3, 64, 64)])
    assert isinstance(out, list) and "boxes" in out[0]


def _trained_qat_model(seed=0):
    torch.manual_seed(seed)
    model = MnistCNN()
    x = torch.randn(8, 1, 28, 28)
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    return q, x


def test_state_dict_round_trip_is_bit_identical():
    q, x = _trained_qat_model()
    dal.calibrate(q, [torch.randn(8, 1, 28, 28) for _ in range(2)], progress=False)
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    q.train()
    loss = q(x).square().mean()
    loss.backward()
    opt.step()
    state = copy.deepcopy(q.state_dict())
    fresh, _ = _trained_qat_model(seed=1)
    fresh.load_state_dict(state)
    q.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(q(x), fresh(x))


def test_functional_ops_are_quantized_in_resnet_blocks():
    model = torchvision.models.resnet18(weights=None)
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000")
    adds = [r.name for r in dal.prepared(q).report.rows if r.type_name == "QAdd"]
    assert len(adds) == 8 and "layer1.0.add" in adds


def test_recipe_hardware_mismatch_is_refused_and_model_untouched():
    model = torchvision.models.resnet18(weights=None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        dal.prepare_qat(model, recipe="w4a8_fp8_performance", hardware="a1000")
    msg = str(err.value)
    assert "a1000" in msg and ("int4" in msg or "fp8" in msg)
    assert type(model.conv1) is nn.Conv2d
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unknown_module_types_listed_in_strict_mode():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w

    model = nn.Sequential(nn.Linear(3, 3), Custom(), Custom())
    with pytest.raises(ValueError, match=r"2 module\(s\).*\n.*1: Custom.*\n.*2: Custom"):
        dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", strict=True)
    q = dal.prepare_qat(nn.Sequential(nn.Linear(3, 3), Custom()), recipe="int8_balanced", hardware="a2000")
    assert [r.status for r in dal.prepared(q).report.rows if r.type_name == "Custom"] == ["float"]


def test_register_qat_module_for_a_user_type():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    with pytest.raises(TypeError, match=r"derives from dal.nn.QATModule"):
        dal.register_qat_module(Scale)(type("QScale", (Scale,), {}))

    @dal.register_qat_module(Scale, op_class="mul")
    class QScale(dal.nn.QATModule, Scale):
        @classmethod
        def from_float(cls, mod, spec=None, name=""):
            q = cls()
            q.weight = mod.weight
            q.qat_name = name
            return q

        def to_float(self):
            return self

    q = dal.prepare_qat(nn.Sequential(Scale()), recipe="int8_balanced", hardware="a2000")
    assert type(q[0]).__name__ == "QScale"


def test_calibrate_errors_name_the_problem():
    q, x = _trained_qat_model()
    with pytest.raises(ValueError, match="no batch"):
        dal.calibrate(q, [], progress=False)
    bad = torch.randn(8, 1, 28, 28)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="batch 0.*NaN"):
        dal.calibrate(q, [bad], progress=False)
    with pytest.raises(ValueError, match=r"batch 0 \(input shapes \[\(8, 3, 28, 28\)\]\) failed"):
        dal.calibrate(q, [torch.randn(8, 3, 28, 28)], progress=False)
