"""QConvBnReLU2d's ReLU in place in training (``apply_activation(..., inplace=True)``) against the
out-of-place route it replaced, bit for bit.

Oracle: torch's own out-of-place ``F.relu`` (and its autograd) on the same tensor. At the module
level the reference is a deep copy of the layer with its fused activation removed, followed by
``F.relu``: exactly the former ``finish``. Compared as raw bits (NaN payloads and the sign of zero
included): the output, the gradients of the input and of every Parameter, and every buffer
(observer ranges, scales, zero points, BN running statistics), over two training steps, on each of
the layer's three training routes (1/f on the weight, 1/f on the conv output, frozen BN), with
edge inputs (an all-zero batch, signed zeros, a NaN in the input).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dal.nn import QConvBnReLU2d, apply_activation, layer_spec, tensor_spec
from dal.prepare.state import set_quantizer_state

SPEC = layer_spec(weight=tensor_spec("int8", "per_channel"),
                  input=tensor_spec("uint8", symmetric=False, observer="moving_average"))
#: float32 values at the edges of ReLU: signed zeros, NaNs of both signs, infinities, subnormals
EDGE = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-45, -1e-45,
                     1.5, -1.5, 3.4e38, -3.4e38], dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32) if t.dtype == torch.float32 else t.detach()


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(_bits(a), _bits(b)), f"{what} differs"


def test_apply_activation_relu_in_place_equals_out_of_place():
    g = torch.linspace(-2, 2, EDGE.numel())
    outs, grads = [], []
    for inplace in (False, True):
        x = EDGE.clone().requires_grad_()
        y = x * 1.0  # a fresh non-leaf tensor, as a layer's own result
        out = apply_activation(y, "relu", inplace=inplace)
        assert (out is y) == inplace
        out.backward(g)
        outs.append(out.detach())
        grads.append(x.grad)
    _same(outs[1], F.relu(EDGE), "relu_ output vs torch.relu")
    _same(outs[1], outs[0], "output")
    _same(grads[1], grads[0], "gradient")


@pytest.mark.parametrize("activation", ["relu6", ("clip", -1.0, 2.0), None])
def test_other_activations_stay_out_of_place(activation):
    y = EDGE.clone()
    out = apply_activation(y, activation, inplace=True)
    _same(y, EDGE, "the input")  # untouched
    _same(out, apply_activation(EDGE.clone(), activation), "output")


def _layer(route: str, seed: int):
    torch.manual_seed(seed)
    if route == "divide_output":  # weight > 32 * outputs + 2**19: the 1/f goes on the conv output
        conv, shape = nn.Conv2d(512, 256, 3, padding=1, bias=True), (2, 512, 2, 2)
    else:
        conv, shape = nn.Conv2d(6, 8, 3, padding=1, bias=False), (4, 6, 5, 5)
    bn = nn.BatchNorm2d(conv.out_channels)
    with torch.no_grad():
        bn.weight.uniform_(-1.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    q = QConvBnReLU2d.from_float(conv, bn, SPEC, "c").train()
    x = torch.randn(shape)
    set_quantizer_state(q, "observe")
    q(x)
    set_quantizer_state(q, "quantize")
    if route == "frozen_bn":
        q.freeze_bn()
        q.train()
    assert q._divide_output(x) == (route == "divide_output")
    return q, shape


def _reference(q):
    """The former route: the same layer without its fused ReLU, then torch's out-of-place ReLU."""
    ref = copy.deepcopy(q)
    ref.activation = None
    return lambda x: F.relu(ref(x)), ref


def _inputs(shape, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "zeros":  # BN output = beta exactly (batch statistics of a constant), ReLU of +-0 and of beta
        x = torch.zeros(shape)
    elif kind == "signed_zeros":
        x[0].zero_()
        x[-1] = -0.0
    elif kind == "nan":
        x[0, 0, 0, 0] = float("nan")
    return x


@pytest.mark.parametrize("route", ["fold_weight", "divide_output", "frozen_bn"])
@pytest.mark.parametrize("kind", ["plain", "zeros", "signed_zeros", "nan"])
def test_conv_bn_relu_training_step_bits(route, kind):
    q, shape = _layer(route, seed=len(route) + len(kind))
    run_ref, ref = _reference(q)
    for step in range(2):
        x = _inputs(shape, kind, seed=step)
        g = torch.randn((shape[0], q.out_channels, shape[2], shape[3]), generator=torch.Generator().manual_seed(9))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out = q(xa)
        out_ref = run_ref(xb)
        _same(out, out_ref, f"step {step}: output")
        out.backward(g)
        out_ref.backward(g)
        _same(xa.grad, xb.grad, f"step {step}: input gradient")
        params, ref_params = dict(q.named_parameters()), dict(ref.named_parameters())
        assert params.keys() == ref_params.keys()
        for name, p in params.items():
            assert (p.grad is None) == (ref_params[name].grad is None), name
            if p.grad is not None:
                _same(p.grad, ref_params[name].grad, f"step {step}: grad of {name}")
                p.grad = ref_params[name].grad = None
        buffers, ref_buffers = dict(q.named_buffers()), dict(ref.named_buffers())
        assert buffers.keys() == ref_buffers.keys()
        for name, b in buffers.items():
            _same(b, ref_buffers[name], f"step {step}: buffer {name}")


class _Names(TorchFunctionMode):
    """Records the torch functions a forward calls, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("training", [True, False])
def test_relu_in_place_in_training_only(training):
    """Training takes the in-place ReLU (so the bit tests above compare two different routes); eval
    (export's trace, convert's probes) keeps torch's out-of-place one, and its output is the reference's."""
    q, shape = _layer("fold_weight", seed=3)
    q.train(training)
    run_ref, _ = _reference(q)
    x = torch.randn(shape)
    with torch.no_grad(), _Names() as rec:
        y = q(x)
    assert ("relu_" in rec.names) == training and ("relu" in rec.names) != training, rec.names
    if not training:
        with torch.no_grad():
            _same(y, run_ref(x), "eval output")
