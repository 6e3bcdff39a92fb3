"""Replacement rules match library classes by what they compute, not by their class.

``lut_activation`` used to match only torch.nn's classes: timm's GELU / Swish / HardSwish layers
and transformers' GELUActivation / NewGELUActivation were left as float activations, so on the
a1000 its own suggested fix ("add lut_activation") left them refused. They are now recognised by
running them once on a probe (dal.replace.activation_probe), checked here against torch's own
functions. ``npu_attention`` matched nothing in timm's ViT: its Attention passes its own
``is_causal`` argument to F.scaled_dot_product_attention; NpuSDPA now takes it at run time.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.replace import auto_replace
from dal.replace.activation_probe import probe_activation
from dal.replace.lut import LutActivation

timm = pytest.importorskip("timm")
from timm.layers import activations as timm_act  # noqa: E402

X = torch.linspace(-12, 12, 1001)
TORCH = {("gelu", "none"): lambda x: F.gelu(x), ("gelu", "tanh"): lambda x: F.gelu(x, approximate="tanh"),
         ("silu", "none"): F.silu, ("sigmoid", "none"): torch.sigmoid, ("tanh", "none"): torch.tanh,
         ("hardswish", "none"): F.hardswish, ("hardsigmoid", "none"): F.hardsigmoid}


@pytest.mark.parametrize("cls, want", [(timm_act.GELU, ("gelu", "none")), (timm_act.GELUTanh, ("gelu", "tanh")),
                                       (timm_act.Swish, ("silu", "none")), (timm_act.HardSwish, ("hardswish", "none")),
                                       (timm_act.Sigmoid, ("sigmoid", "none")), (timm_act.Tanh, ("tanh", "none"))])
def test_timm_activation_classes_are_recognised(cls, want):
    assert probe_activation(cls()) == want
    lut = auto_replace(nn.Sequential(cls()), ["lut_activation"], "a1000").replacements
    assert len(lut) == 1
    # the replacement computes torch's own function (ONNX's HardSigmoid formula: within an ulp)
    torch.testing.assert_close(LutActivation(*want)(X), TORCH[want](X), rtol=0, atol=1e-6)


def test_transformers_activation_classes_are_recognised():
    activations = pytest.importorskip("transformers.activations")
    assert probe_activation(activations.GELUActivation()) == ("gelu", "none")
    assert probe_activation(activations.NewGELUActivation()) == ("gelu", "tanh")  # its own tanh formula
    assert probe_activation(activations.SiLUActivation()) == ("silu", "none")
    assert probe_activation(activations.QuickGELUActivation()) is None  # x * sigmoid(1.702 x): no table here
    assert probe_activation(activations.ClippedGELUActivation(-10, 10)) is None  # clipped beyond +-10


class Twice(nn.Module):
    def forward(self, x):
        return x * 2


class Noisy(nn.Module):
    def forward(self, x):
        return F.gelu(x) + torch.rand_like(x) * 0


class Weighted(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return F.gelu(x) * self.w


@pytest.mark.parametrize("mod", [Twice(), Noisy(), Weighted(), timm_act.QuickGELU(), timm_act.Mish()])
def test_other_modules_are_not_activations(mod):
    assert probe_activation(mod) is None


def test_hf_vit_gelu_through_the_table_on_the_a1000():
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8, attn_implementation="eager")
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    rep = auto_replace(model, ["lut_activation"], "a1000", (torch.randn(1, 3, 32, 32),))
    assert sorted(r.path for r in rep.by_rule("lut_activation")) == ["layers.0.mlp.activation_fn",
                                                                     "layers.1.mlp.activation_fn"]
    assert all(isinstance(model.get_submodule(r.path), LutActivation) and r.cosine > 0.999999
               for r in rep.replacements)


def _vit(depth=1):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=depth).eval()


def test_timm_attention_is_npu_attention_and_keeps_is_causal():
    model = _vit()
    attn = model.blocks[0].attn
    x = torch.randn(2, 17, 192)
    with torch.no_grad():
        want, want_causal = attn(x), attn(x, is_causal=True)
    rep = auto_replace(model, ["npu_attention"], None, (torch.randn(1, 3, 32, 32),))
    assert [r.path for r in rep.by_rule("npu_attention")] == ["blocks.0.attn"]
    new = model.blocks[0].attn
    assert hasattr(new, "npu_sdpa")
    with torch.no_grad():  # torch's fused SDPA against explicit float32 matmuls: float rounding only
        torch.testing.assert_close(new(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new(x, is_causal=True), want_causal, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(want, want_causal, atol=1e-3)  # the flag changes the result


def test_timm_vit_with_npu_attention_verifies_bit_exact():
    model = _vit(depth=2)
    x = torch.randn(2, 3, 32, 32)
    rec = {"name": "vit", "replace": ["npu_attention", "lut_activation", "layernorm_fp16"],
           "rules": [{"type": ["conv", "linear", "matmul", "add"], "weight": "int8", "input": "uint8"}]}
    qat = dal.prepare_qat(model, rec, hardware="a2000", example_inputs=(x,))
    g = torch.Generator().manual_seed(1)
    dal.calibrate(qat, [torch.randn(x.shape, generator=g) for _ in range(2)], progress=False)
    qat.eval()
    rows = {r.name: r for r in dal.prepared(qat).report.rows}
    assert rows["blocks.0.attn.npu_sdpa.core.matmul"].type_name == "QMatMul"
    report = dal.verify(dal.export_onnx(qat, (x,)), qat, (x,), onnxruntime=False)
    assert report.integer.identical, report.integer  # dal.convert == dal.npu on every element
