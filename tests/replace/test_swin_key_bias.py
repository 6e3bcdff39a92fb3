"""Swin V2's unused key bias (torchvision's ShiftedWindowAttentionV2 never adds the k part of
qkv.bias): the NPU replacement zeroes it and keeps its gradient at zero, once per bias."""
import torch
from torch import nn
from torchvision.models.swin_transformer import ShiftedWindowAttentionV2

from dal.replace import auto_replace


def test_the_key_bias_is_zeroed_and_masked_once():
    torch.manual_seed(0)
    attn = ShiftedWindowAttentionV2(32, [4, 4], [0, 0], 4)
    with torch.no_grad():
        attn.qkv.bias.normal_()
    model = nn.Sequential(attn)
    x = torch.randn(2, 8, 8, 32)
    auto_replace(model, ["npu_attention"], None, (x,))
    bias = model[0].qkv.bias
    assert bias is attn.qkv.bias and torch.equal(bias[32:64], torch.zeros(32))
    assert model[0].zero_unused_key_bias() is False  # already masked: no second gradient hook
    model(x).sum().backward()
    assert torch.equal(bias.grad[32:64], torch.zeros(32))
    assert bias.grad[:32].abs().sum() > 0 and bias.grad[64:].abs().sum() > 0
