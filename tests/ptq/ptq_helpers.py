"""Shared by the dal.ptq tests: a depthwise-separable MNIST net, briefly trained, and small helpers."""
import copy
import functools

import torch
from torch import nn

INT8_PER_TENSOR = {"name": "int8_per_tensor_w", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int8", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
    {"type": ["add", "pool"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}

W4A8_PER_CHANNEL = {"name": "w4a8_pc", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
    {"type": ["add", "pool"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}


class DepthwiseNet(nn.Module):
    """conv -> depthwise -> pointwise -> depthwise (stride 2) -> pointwise, BN + ReLU each, a
    linear head: the chain cross-layer equalization is for."""

    def __init__(self, width: int = 16):
        super().__init__()

        def block(cin, cout, groups=1, stride=1, k=3):
            return [nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
                    nn.BatchNorm2d(cout), nn.ReLU()]

        w = width
        self.features = nn.Sequential(*block(1, w), *block(w, w, groups=w), *block(w, 2 * w, k=1),
                                      *block(2 * w, 2 * w, groups=2 * w, stride=2), *block(2 * w, 2 * w, k=1),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * w, 10)

    def forward(self, x):
        return self.head(self.features(x))


def mnist_batches(n_train=5000, calib=128, test=1024):
    from dal_examples.datasets import load_mnist

    data = load_mnist()
    norm = lambda x: (x - 0.1307) / 0.3081  # noqa: E731
    xtr, ytr = data["train"]
    xva, yva = data["valid"]
    xtr, ytr, xva = norm(xtr[:n_train]), ytr[:n_train], norm(xva)
    train = [(xtr[i:i + 64], ytr[i:i + 64]) for i in range(0, n_train, 64)]
    cal = [(xva[i:i + 32], yva[i:i + 32]) for i in range(0, calib, 32)]
    tst = [(xva[i:i + 256], yva[i:i + 256]) for i in range(2048, 2048 + test, 256)]
    return train, cal, tst


def trained_depthwise(unequal: bool = True):
    """A fresh copy of ``_trained_depthwise(unequal)`` (trained once per test process)."""
    net, cal, tst = _trained_depthwise(unequal)
    return copy.deepcopy(net), cal, tst


@functools.lru_cache(maxsize=None)
def _trained_depthwise(unequal: bool = True):
    """(float DepthwiseNet (eval, BN folded when ``unequal``), calib, test). With ``unequal``,
    after training each channel of the first conv and of the first pointwise conv is
    multiplied by a factor in [1/30, 30] and the next layer divided by it: the same function,
    with the unequal channel ranges that per-tensor weight quantization suffers from."""
    from dal.ptq import fold_batchnorm
    from dal_examples.training import train_epoch

    torch.manual_seed(0)
    train, cal, tst = mnist_batches()
    net = DepthwiseNet()
    train_epoch(net, train, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    net.eval()
    fold_batchnorm(net)
    if unequal:
        unequal_channels(net)
    return net, cal, tst


def unequal_channels(net: "DepthwiseNet") -> None:
    """In place: each output channel of the first conv and of the first pointwise conv times a
    seeded factor in [1/30, 30], and the next (depthwise) layer's channel divided by it: the same
    function (ReLU commutes with a positive scale), with unequal per-channel weight ranges."""
    g = torch.Generator().manual_seed(1)
    f = net.features
    with torch.no_grad():
        for a, b in ((f[0], f[3]), (f[6], f[9])):
            s = torch.exp((torch.rand(a.out_channels, generator=g) * 2 - 1) * 3.4)  # 1/30 .. 30
            a.weight.mul_(s.reshape(-1, 1, 1, 1))
            a.bias.mul_(s)
            b.weight.div_(s.reshape(-1, 1, 1, 1))  # depthwise: channel i of b reads channel i


@functools.lru_cache(maxsize=None)
def _mnist_cnn():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from mnist_helpers import trained_mnist

    return trained_mnist()


def mnist_cnn():
    """tests/mnist_helpers.trained_mnist(), trained once per test process; a fresh model copy."""
    net, calib, test = _mnist_cnn()
    return copy.deepcopy(net), calib, test


def accuracy(model, batches) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in batches)
    return 100.0 * correct / sum(len(y) for _, y in batches)


def ptq(model, recipe, calib, steps=(), **kw):
    from dal.ptq import quantize_ptq

    return quantize_ptq(copy.deepcopy(model), recipe, calib, hardware="a2000", steps=steps, **kw)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


W4A8_PER_TENSOR_ALL = {"name": "w4a8_per_tensor_all", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int4", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
    {"type": ["add", "pool", "activation"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}


@functools.lru_cache(maxsize=None)
def _trained_mobilenet():
    """(float dal_examples.zoo.MobileNetTiny(8), eval, one Adam epoch over 5k MNIST images, calib, test)."""
    from dal_examples.training import train_epoch
    from dal_examples.zoo import MobileNetTiny

    torch.manual_seed(0)
    train, cal, tst = mnist_batches()
    net = MobileNetTiny(8)
    train_epoch(net, train, torch.optim.Adam(net.parameters(), lr=0.01))
    return net.eval(), cal, tst


def trained_mobilenet():
    """A fresh copy of the briefly trained MobileNetTiny(8) (trained once per test process)."""
    net, cal, tst = _trained_mobilenet()
    return copy.deepcopy(net), cal, tst
