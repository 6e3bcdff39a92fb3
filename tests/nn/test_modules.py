"""QAT modules against torch's own float modules and fake-quant ops (independent oracles)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dal.nn import (QAdd, QCat, QConv1d, QConv2d, QConvBn2d, QConvBnReLU2d, QConvTranspose2d, QEmbedding,
                    QLinear, QMatMul, SimpleLayerSpec, SimpleTensorSpec)
from dal.prepare.state import set_quantizer_state

INT8 = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel"), input=SimpleTensorSpec("int8"),
                       output=SimpleTensorSpec("int8"))


def _calibrate(mod, *inputs):
    set_quantizer_state(mod, "observe")
    mod(*inputs)
    set_quantizer_state(mod, "frozen")


@pytest.mark.parametrize("make,cls,x", [
    (lambda: nn.Linear(16, 8), QLinear, torch.randn(4, 16)),
    (lambda: nn.Conv1d(4, 8, 3, padding=1), QConv1d, torch.randn(2, 4, 10)),
    (lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, groups=2), QConv2d, torch.randn(2, 4, 9, 9)),
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2), QConvTranspose2d, torch.randn(2, 4, 5, 5)),
])
def test_from_float_shares_parameters_and_off_equals_float(make, cls, x):
    torch.manual_seed(0)
    fm = make()
    ref = fm(x)
    params = dict(fm.named_parameters())
    q = cls.from_float(fm, INT8, "layer")
    assert all(dict(q.named_parameters())[k] is p for k, p in params.items())
    set_quantizer_state(q, "off")
    assert torch.equal(q(x), ref)
    back = q.to_float()
    assert type(back) is type(fm) and back.weight is fm.weight
    assert torch.equal(back(x), ref)


def test_qlinear_matches_torch_fake_quant_with_power_of_two_scales():
    # Power-of-two scales: torch's multiply-by-reciprocal equals ONNX's divide exactly.
    torch.manual_seed(1)
    lin = nn.Linear(32, 16, bias=False)
    q = QLinear.from_float(lin, SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel"),
                                                input=SimpleTensorSpec("int8")), "fc")
    x = torch.randn(8, 32)
    _calibrate(q, x)
    w_scale = torch.exp2(torch.round(torch.log2(q.weight_quant.scale)))
    q.weight_quant.scale.copy_(w_scale)
    q.input_quant.scale.fill_(2.0 ** -5)
    xq = torch.fake_quantize_per_tensor_affine(x, 2.0 ** -5, 0, -128, 127)
    wq = torch.fake_quantize_per_channel_affine(lin.weight, w_scale, torch.zeros(16, dtype=torch.int32), 0, -128, 127)
    assert torch.equal(q(x), F.linear(xq, wq))


def test_int32_bias_is_input_scale_times_weight_scale():
    torch.manual_seed(2)
    conv = nn.Conv2d(3, 4, 3)
    q = QConv2d.from_float(conv, INT8, "c")
    x = torch.randn(2, 3, 6, 6)
    _calibrate(q, x)
    s = (q.input_quant.scale.double() * q.weight_quant.scale.double()).float().double()
    expected = (torch.round(conv.bias.double() / s) * s).float()
    got = q.quantized_bias(conv.bias)
    assert torch.equal(got, expected)


def _bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return bn


@pytest.mark.parametrize("cls,relu", [(QConvBn2d, False), (QConvBnReLU2d, True)])
def test_conv_bn_eval_off_equals_float_conv_bn(cls, relu):
    torch.manual_seed(3)
    conv, bn = nn.Conv2d(3, 8, 3, padding=1, bias=True), _bn(8)
    ref = nn.Sequential(conv, bn, *([nn.ReLU()] if relu else [])).eval()
    x = torch.randn(2, 3, 8, 8)
    expected = ref(x)
    q = cls.from_float(conv, bn, INT8, "c").eval()
    set_quantizer_state(q, "off")
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls,relu", [(QConvBn2d, False), (QConvBnReLU2d, True)])
def test_conv_bn_to_float_is_the_float_modules(cls, relu):
    """to_float gives back conv, BN (and ReLU) with exactly the float modules' state: no QAT buffer
    (bn_frozen, weight_mask) is left on the returned Conv2d."""
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), _bn(8)
    keys = set(nn.Sequential(conv, bn).state_dict())
    back = cls.from_float(conv, bn, INT8, "c").to_float()
    assert [type(m) for m in back] == [nn.Conv2d, nn.BatchNorm2d] + ([nn.ReLU] if relu else [])
    assert set(back.state_dict()) == keys and back[0].weight is conv.weight


def test_conv_bn_training_tracks_batch_statistics_like_float_bn():
    torch.manual_seed(4)
    conv, bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), _bn(8)
    conv_ref, bn_ref = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
    conv_ref.load_state_dict(conv.state_dict())
    bn_ref.load_state_dict(bn.state_dict())
    ref = nn.Sequential(conv_ref, bn_ref).train()
    q = QConvBn2d.from_float(conv, bn, INT8, "c").train()
    set_quantizer_state(q, "off")
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8)
        torch.testing.assert_close(q(x), ref(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var)


def test_conv_bn_frozen_stops_statistics_and_trains_folded():
    torch.manual_seed(5)
    conv, bn = nn.Conv2d(3, 8, 3, padding=1), _bn(8)
    q = QConvBn2d.from_float(conv, bn, INT8, "c").train()
    x = torch.randn(4, 3, 8, 8)
    _calibrate(q, x)
    q.freeze_bn().train()
    mean = bn.running_mean.clone()
    y_train = q(x)
    assert torch.equal(bn.running_mean, mean)
    assert torch.equal(y_train, q.eval()(x))


def test_quantized_conv_bn_weights_are_on_the_int8_grid():
    torch.manual_seed(6)
    conv, bn = nn.Conv2d(3, 8, 3), _bn(8)
    q = QConvBn2d.from_float(conv, bn, INT8, "c").eval()
    x = torch.randn(2, 3, 8, 8)
    _calibrate(q, x)
    w, _ = q.folded_weight_and_bias()
    wq = q.weight_quant(w)
    codes = wq / q.weight_quant.scale.reshape(-1, 1, 1, 1)
    # (k * s) / s is k up to one float rounding: every value sits on the integer grid.
    assert (codes - torch.round(codes)).abs().max() < 1e-4 and codes.abs().max() <= 127.0001


def test_functional_modules_compute_the_float_op_when_off():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    spec = SimpleLayerSpec(input=SimpleTensorSpec("int8"))
    for mod, expected in ((QAdd(spec, "add"), a + b), (QMatMul(spec, "mm"), a @ b.T),
                          (QCat(spec, "cat", arity=2, dim=1), torch.cat([a, b], 1))):
        set_quantizer_state(mod, "off")
        got = mod(a, b.T) if isinstance(mod, QMatMul) else mod(a, b)
        assert torch.equal(got, expected)


def test_qadd_quantizes_each_input_on_its_own_grid():
    spec = SimpleLayerSpec(input=SimpleTensorSpec("int8"), output=SimpleTensorSpec("int8"))
    mod = QAdd(spec, "add")
    a, b = torch.randn(64), 10 * torch.randn(64)
    _calibrate(mod, a, b)
    sa, sb = float(mod.input_quants[0].scale), float(mod.input_quants[1].scale)
    qa = torch.clamp(torch.round(a / sa), -128, 127) * sa
    qb = torch.clamp(torch.round(b / sb), -128, 127) * sb
    so = float(mod.output_quant.scale)
    expected = torch.clamp(torch.round((qa + qb) / so), -128, 127) * so
    assert torch.equal(mod(a, b), expected)


def test_embedding_table_quantized_per_row():
    emb = nn.Embedding(10, 8)
    q = QEmbedding.from_float(emb, INT8, "emb")
    idx = torch.tensor([[1, 2], [3, 9]])
    _calibrate(q, idx)
    s = q.weight_quant.scale
    table = torch.clamp(torch.round(emb.weight / s.reshape(-1, 1)), -128, 127) * s.reshape(-1, 1)
    so = float(q.output_quant.scale)
    expected = torch.clamp(torch.round(table[idx] / so), -128, 127) * so
    assert torch.equal(q(idx), expected)
