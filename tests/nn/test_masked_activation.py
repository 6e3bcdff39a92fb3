"""dal.nn.masked_activation: a prepared model's in-place ReLU / ReLU6 modules train by the
bit-mask node, with torch's values and gradients, and stay the modules they were."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import dal
from dal.formats import native
from dal.formats.relu_mask import ReluMaskFunction
from dal.nn import masked_activation
from dal.nn.masked_activation import MaskedActivation

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

X = (2, 3, 16, 16)


@pytest.fixture(autouse=True)
def small_tensors_too(monkeypatch):
    """These nets are small: take the bit-mask node below its size bound too."""
    monkeypatch.setattr(masked_activation, "MIN_ELEMENTS", 0)


def _net(act):
    """conv, BN, max pool (so that prepare does not fuse a ReLU into the conv), act, conv."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.MaxPool2d(2), act, nn.Conv2d(8, 4, 1))


def _prepared(model):
    x = torch.randn(X)
    model = dal.prepare_qat(model.train(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [x], num_batches=1, progress=False)
    return model.train()


def _activation(model, cls):
    return next(m for m in model.modules() if type(m) is cls)


@pytest.mark.parametrize("cls", [nn.ReLU, nn.ReLU6])
def test_an_in_place_activation_trains_as_torchs_op(cls):
    fast = _prepared(_net(cls(inplace=True)))
    act = _activation(fast, cls)
    assert isinstance(act.__dict__.get("forward"), MaskedActivation)
    slow = copy.deepcopy(fast)
    _activation(slow, cls).__dict__.pop("forward")  # torch's own module forward
    seen = []
    act.register_forward_hook(lambda m, i, o: seen.append(type(o.grad_fn)))  # hooks still run
    x = torch.randn(X) * 3  # some values above 6
    outs = []
    for model in (fast, slow):
        y = model(x)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), [p.grad for p in model.parameters()]))
    assert seen == [ReluMaskFunction._backward_cls]
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_not_in_place_and_no_grad_are_torchs():
    model = _prepared(_net(nn.ReLU6()))  # inplace=False: its input may have other readers
    assert "forward" not in _activation(model, nn.ReLU6).__dict__
    model = _prepared(_net(nn.ReLU6(inplace=True)))
    act, seen = _activation(model, nn.ReLU6), []
    act.register_forward_hook(lambda m, i, o: seen.append(o.grad_fn))
    x = torch.randn(X) * 3
    with torch.no_grad():
        y = model.eval()(x)
        act.__dict__.pop("forward")  # torch's own module forward
        assert seen == [None] and torch.equal(y, model(x))


def test_a_small_tensor_takes_torchs_op(monkeypatch):
    monkeypatch.setattr(masked_activation, "MIN_ELEMENTS", 2 * 8 * 8 * 8 + 1)  # the pooled tensor, plus one
    model = _prepared(_net(nn.ReLU6(inplace=True)))
    seen = []
    _activation(model, nn.ReLU6).register_forward_hook(lambda m, i, o: seen.append(type(o.grad_fn).__name__))
    model(torch.randn(X)).sum().backward()
    assert seen == ["HardtanhBackward0"]


class _Calls(TorchFunctionMode):
    """Records the torch functions called at the top level (what dal.convert's probe reads)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cls, call", [(nn.ReLU, F.relu), (nn.ReLU6, F.hardtanh)])
@pytest.mark.parametrize("grad", [True, False])
def test_under_a_function_mode_or_where_the_kernel_does_not_apply_it_is_the_modules_own_call(cls, call, grad):
    """No grad: the kernel does not apply; grad on: a mode would not see the autograd Function.
    Either way the mode sees the call an unprepared module makes, with its arguments."""
    act = cls(inplace=True)
    assert masked_activation.install(nn.Sequential(act)) == 1
    y = torch.randn(64, requires_grad=True) * 3
    y = y if grad else y.detach()
    with torch.set_grad_enabled(grad), _Calls() as calls:
        out = act(y)
    assert calls.seen == [call]
    assert torch.equal(out, torch.clamp(y.detach(), 0, 6 if cls is nn.ReLU6 else None))


def test_a_saved_or_copied_model_keeps_the_masked_forward_of_its_own_module(tmp_path):
    model = _prepared(_net(nn.ReLU6(inplace=True)))
    torch.save(model, tmp_path / "m.pt")
    for other in (torch.load(tmp_path / "m.pt", weights_only=False), copy.deepcopy(model)):
        act = _activation(other, nn.ReLU6)
        assert isinstance(act.__dict__["forward"], MaskedActivation) and act.forward.module is act
        seen = []
        act.register_forward_hook(lambda m, i, o: seen.append(type(o.grad_fn)))
        other(torch.randn(X)).sum().backward()
        assert seen == [ReluMaskFunction._backward_cls]
