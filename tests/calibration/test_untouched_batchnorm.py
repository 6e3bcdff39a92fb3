"""A QAT step after calibrating a random-init network: gradients comparable to the float model's.

The mechanism (measured on timm ghostnetv2_100 at 64x64: 1e13 against 0.33): calibration runs
in eval mode, where BatchNorm layers with untouched statistics (mean 0, var 1) let the random-init
activations shrink layer after layer; a training step's BN (batch statistics) restores them to ~1,
the quantizers sized for eval clip them into a tiny range, and the next BN divides by the tiny batch
standard deviation: the gradient grows by that factor per layer. ``calibrate(bn_statistics="auto")``
estimates the untouched statistics from the data first; the oracles are the float
model's own gradient and torch's ``swa_utils.update_bn``.
"""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn

import dal


def deep_net(depth: int = 12) -> nn.Module:
    """conv3x3-BN-ReLU x depth, torch's default init: each layer's eval output is ~1/2.4 of its
    input with untouched BN statistics, so the last is ~1e-5 of the first; then pool and linear."""
    torch.manual_seed(0)
    layers, c = [], 3
    for _ in range(depth):
        layers += [nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
        c = 8
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _inputs():
    torch.manual_seed(1)
    return torch.randn(8, 3, 16, 16)


def step_gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One training step's gradients by parameter name (loss: mean log-sum-exp of the logits).
    The names of a QAT model are the float model's (``QConvBn2d`` keeps the conv's weight and
    bias and holds the BN as ``bn``): ``0.weight`` -> ``0.weight``, ``1.weight`` -> ``0.bn.weight``."""
    model.train()
    model.zero_grad()
    model(x).logsumexp(1).mean().backward()
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_norm(grads: dict) -> float:
    return float(torch.sqrt(sum((g ** 2).sum() for g in grads.values())))


def conv_weight_ratios(net: nn.Module, q: nn.Module, x: torch.Tensor) -> list[float]:
    """|grad| of each conv weight in a QAT step over the float model's, in layer order."""
    f, g = step_gradients(copy.deepcopy(net), x), step_gradients(q, x)
    names = [n for n, m in net.named_modules() if isinstance(m, nn.Conv2d)]
    return [float(g[n + ".weight"].norm() / f[n + ".weight"].norm()) for n in names]


def _qat(net, x, **kw):
    q = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dal.calibrate(q, [x], progress=False, **kw)
    return q, [str(w.message) for w in caught if "BatchNorm layer(s)" in str(w.message)]


def test_a_qat_step_has_the_float_models_gradients_layer_by_layer():
    net, x = deep_net(), _inputs()
    float_norm = grad_norm(step_gradients(copy.deepcopy(net), x))  # batch statistics: running ones unused
    q, msgs = _qat(net, x, bn_statistics="auto")
    assert len(msgs) == 1 and "12 BatchNorm layer(s)" in msgs[0] and "Estimated" in msgs[0], msgs
    assert 0.1 < grad_norm(step_gradients(q, x)) / float_norm < 10
    ratios = conv_weight_ratios(net, q, x)
    assert len(ratios) == 12 and all(0.1 < r < 10 for r in ratios), ratios


def test_keeping_the_untouched_statistics_trains_nothing_and_says_why():
    """The old behaviour, kept on request: eval-mode ranges ~1e-5 of the train-mode activations at
    the last layers; the classifier's input quantizer clips every value of a training step, and its
    straight-through gradient is 0 there: no conv layer gets a gradient. (On GhostNetV2 the SE and
    DFC gates give the gradient other paths, and each BN whose input the clipping made constant
    multiplies it by ``gamma / sqrt(0 + eps)`` = 316: 1e13 where the float model has 0.33.)"""
    net, x = deep_net(), _inputs()
    q, msgs = _qat(net, x, bn_statistics="keep")
    assert len(msgs) == 1 and "bn_statistics='auto'" in msgs[0], msgs
    assert all(bool(m.running_var.eq(1).all()) for m in q.modules() if isinstance(m, nn.BatchNorm2d))
    assert conv_weight_ratios(net, q, x) == [0.0] * 12


def test_the_estimate_is_torchs_update_bn():
    net, x = deep_net(4), _inputs()
    batches = [x, 2 * x + 1, x[:3]]
    oracle = copy.deepcopy(net)
    update_bn(batches, oracle)
    q = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    modes = [m.training for m in q.modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dal.calibrate(q, iter(batches), progress=False, bn_statistics="auto")  # one-shot: both passes see all three
    ours = {n: b for n, b in q.named_buffers() if n.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    ref = {n: b for n, b in oracle.named_buffers() if n.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    assert len(ours) == len(ref) == 12
    # QConvBn2d's train-mode forward computes W*f/f instead of W: float rounding only
    for (n_ours, a), (n_ref, b) in zip(ours.items(), ref.items()):  # module order
        assert n_ours.rsplit(".", 1)[1] == n_ref.rsplit(".", 1)[1]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n_ours)
    assert [m.training for m in q.modules()] == modes  # each module's mode as before
    assert all(m.momentum == 0.1 for m in q.modules() if isinstance(m, nn.BatchNorm2d))


def test_set_statistics_are_left_alone():
    """A model whose BN statistics were set (trained, loaded) calibrates exactly as with 'keep'."""
    net, x = deep_net(4), _inputs()
    update_bn([x * 3], net)
    net.eval()
    auto, msgs = _qat(net, x, bn_statistics="auto")
    keep, _ = _qat(net, x, bn_statistics="keep")
    assert msgs == []
    a, k = auto.state_dict(), keep.state_dict()
    assert a.keys() == k.keys()
    for key in a:
        assert torch.equal(a[key], k[key]), key


def test_bad_option_is_named():
    net, x = deep_net(2), _inputs()
    q = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    with pytest.raises(ValueError, match="bn_statistics='sometimes'"):
        dal.calibrate(q, [x], progress=False, bn_statistics="sometimes")


def test_a_frozen_untouched_batchnorm_is_named_and_nothing_changes():
    net, x = deep_net(2), _inputs()
    q = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    q.get_submodule("0").freeze_bn()
    before = {k: v.clone() for k, v in q.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Estimated" warning either
        with pytest.raises(ValueError, match=r"calibrate: 0 has a frozen BatchNorm .* bn_statistics='keep'"):
            dal.calibrate(q, [x], progress=False, bn_statistics="auto")
    after = q.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
