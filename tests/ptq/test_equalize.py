"""Cross-layer equalization (dal.ptq.equalize) and BN folding: the float function is unchanged;
per-tensor INT8 PTQ of a net with unequal channel ranges gets better."""
import copy

import pytest
import torch
from torch import nn

from dal.ptq import ChannelClip, equalization_pairs, equalize, fold_batchnorm
from ptq_helpers import (INT8_PER_TENSOR, DepthwiseNet, max_rel_diff, ptq, trained_depthwise,
                         unequal_channels)


def test_mobilenet_v2_function_unchanged():
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.mobilenet_v2(weights=None).eval()
    # Non-trivial BN statistics, so folding has something to fold.
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        ref = net(x)
    work = copy.deepcopy(net)
    assert len(fold_batchnorm(work)) == 52
    pairs = equalize(work)
    # stem -> depthwise, then per block expand -> depthwise -> project (16 expanding blocks, one
    # without expansion), plus the two project -> next conv links no residual add interrupts.
    assert len(pairs) == 36
    assert any(isinstance(m, ChannelClip) for m in work.modules())  # through ReLU6
    with torch.no_grad():
        out = work(x)
    assert max_rel_diff(out, ref) <= 1e-5
    # The ranges really moved: per pair, the two sides now have equal ranges per channel.
    mods = dict(work.named_modules())
    a, b = mods[pairs[0][0]], mods[pairs[0][1]]
    r1 = a.weight.abs().flatten(1).amax(1)
    r2 = b.weight.abs().flatten(1).amax(1) if b.groups > 1 else b.weight.abs().transpose(0, 1).flatten(1).amax(1)
    assert torch.allclose(r1, r2, rtol=0.2)


def test_depthwise_chain_function_unchanged_and_pairs():
    net, _, test = trained_depthwise()
    x = test[0][0][:64]
    with torch.no_grad():
        ref = net(x)
    pairs = equalize(net)
    names = [p[:2] for p in pairs]
    # conv -> dw, dw -> pw, pw -> dw, dw -> pw: every link of the chain (not into the pooled head)
    assert names == [("features.0", "features.3"), ("features.3", "features.6"), ("features.6", "features.9"),
                     ("features.9", "features.12")]
    with torch.no_grad():
        assert max_rel_diff(net(x), ref) <= 1e-5


def _constructed_depthwise(unequal: bool) -> DepthwiseNet:
    """A DepthwiseNet built, not trained (the same weights on every CPU: torch's seeded
    initialisation), BN statistics set and folded. With ``unequal`` each channel of the first
    conv and of the first pointwise conv is multiplied by a factor in [1/30, 30] and the next
    (depthwise) layer's channel divided by it: the same function (ReLU commutes with a positive
    scale), with the unequal channel ranges a per-tensor weight grid suffers from."""
    torch.manual_seed(0)
    net = DepthwiseNet().eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    fold_batchnorm(net)
    if unequal:
        unequal_channels(net)
    return net


def test_equalization_improves_int8_per_tensor_ptq():
    """Per-tensor INT8 PTQ error, ||y_q - y||^2 / ||y||^2 against the float net run in float64,
    on MNIST images: the unequal channels make it far worse than the same net with equal ones
    (the hard case), and equalization brings it back to the equal net's error."""
    from ptq_helpers import mnist_batches

    _, calib, test = mnist_batches(n_train=0)
    x = torch.cat([b[0] for b in test])
    equal, unequal = _constructed_depthwise(False), _constructed_depthwise(True)
    with torch.no_grad():
        ref = copy.deepcopy(unequal).double()(x.double())
        assert max_rel_diff(equal(x), ref) <= 1e-5  # the same function

    def error(model) -> float:
        with torch.no_grad():
            y = model.eval()(x).double()
        return float((y - ref).pow(2).sum() / ref.pow(2).sum())

    base = error(ptq(equal, INT8_PER_TENSOR, calib))
    plain = error(ptq(unequal, INT8_PER_TENSOR, calib))
    equalized = error(ptq(unequal, INT8_PER_TENSOR, calib, steps=("equalize",)))
    # measured (2026-12-05): base 4.1e-6, plain 6.6e-4, equalized 3.2e-6
    assert plain > 20 * base, (base, plain)  # channels 30x apart round to 0 on a per-tensor grid
    assert equalized < plain / 20, (plain, equalized)
    assert equalized < 2 * base, (base, equalized)


def test_relu6_modes_and_bad_mode():
    net = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU6(), nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        net[0].weight[:4].mul_(20)
    x = torch.randn(4, 3, 5, 5)
    with torch.no_grad():
        ref = net(x)
    skip = copy.deepcopy(net)
    assert equalize(skip, relu6="skip") == []
    clip = copy.deepcopy(net)
    assert equalize(clip) == [("0", "2")] and isinstance(clip[1], ChannelClip)
    with torch.no_grad():
        assert max_rel_diff(clip(x), ref) <= 1e-5
    with pytest.raises(ValueError, match="relu6='clamp'"):
        equalize(copy.deepcopy(net), relu6="clamp")


def test_residual_and_shared_outputs_are_left_alone():
    # down.0's output feeds both the residual add and the next conv: scaling it would change the add.
    from dal_examples.zoo import MnistCNN

    net = MnistCNN().eval()
    fold_batchnorm(net)
    pairs = [(a, b) for a, _, b in equalization_pairs(net)]
    assert pairs == [("stem.0", "down.0")]


def test_fold_batchnorm_needs_eval_mode():
    with pytest.raises(ValueError, match="eval mode"):
        fold_batchnorm(DepthwiseNet().train())
