"""A layer's bound training weight (dal.nn.weight_bound) against the per-layer route, bit for bit,
across everything that must drop or refresh the binding: QConvBn2d (``fq(W * f) / f``) and
QConv2d / QLinear (``fq(W)``).

The per-layer routes (FoldFactorFunction + FakeQuantizer.fold_quantize; the quantizer's
kernel_fake_quantize) are themselves checked against a float64 textbook oracle in
test_conv_bn_training.py (whose steps after the first now run bound) and against torch's ops
in tests/formats and tests/test_quantizer_fast_path.py. Here each case runs the same QAT steps on a
model whose layers bind and on a deep copy whose layers never do, applies the same change to
both, and compares outputs, every gradient and every buffer. A binding that outlived its change
would read or write the old tensors, or use the old constants, and the two would part.
"""
import copy
import io

import pytest
import torch
from torch import nn

import dal.nn.base as base
import dal.nn.conv_bn as conv_bn
from dal.formats import native
from dal.nn import QConv2d, QConvBn2d, QConvBnReLU2d, QLinear, SimpleLayerSpec, SimpleTensorSpec
from dal.nn.weight_bound import BoundWeight
from dal.prepare.state import set_quantizer_state

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

W_ONLY = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel"))


def _plain_model(seed=0):
    """QConv2d / QLinear layers: their weight is the fold with f = 1."""
    torch.manual_seed(seed)
    model = nn.Sequential(QConv2d.from_float(nn.Conv2d(3, 8, 3, padding=1), W_ONLY, "c0"), nn.ReLU(),
                          QConv2d.from_float(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), W_ONLY, "c1"),
                          nn.Flatten(), QLinear.from_float(nn.Linear(8 * 64, 10), W_ONLY, "fc")).train()
    return _calibrated(model)


def _calibrated(model):
    set_quantizer_state(model, "observe")
    with torch.no_grad():
        model(torch.randn(4, 3, 8, 8))
    set_quantizer_state(model, "quantize")
    return model


def _model(seed=0):
    """QConvBn2d layers (their weight is fq(W * f) / f)."""
    torch.manual_seed(seed)
    layers = []
    for i, (cin, cout, groups) in enumerate(((3, 8, 1), (8, 8, 8), (8, 6, 1))):
        conv, bn = nn.Conv2d(cin, cout, 3, padding=1, groups=groups, bias=i == 2), nn.BatchNorm2d(cout)
        with torch.no_grad():
            bn.weight.uniform_(-1.5, 1.5)  # negative gamma: f < 0 on some channels
            bn.running_var.uniform_(0.5, 2)
        cls = QConvBnReLU2d if i == 0 else QConvBn2d
        layer = cls.from_float(conv, bn, W_ONLY, f"l{i}")
        layers.append(layer)
    return _calibrated(nn.Sequential(*layers).train())  # small weights: the 1/f on the weight (the bound route)


MODELS = {"folded": _model, "plain": _plain_model}


@pytest.fixture(params=MODELS)
def pair(request, monkeypatch):
    """(bound model, per-layer copy, number of bound calls so far, ids of modules never bound)."""
    fast = MODELS[request.param]()
    slow = copy.deepcopy(fast)
    never = {id(m) for m in slow.modules()}
    calls = [0]
    real = conv_bn.bound_weight

    def routed(module):
        if id(module) in never:
            return None
        w = real(module)
        calls[0] += w is not None
        return w
    monkeypatch.setattr(conv_bn, "bound_weight", routed)
    monkeypatch.setattr(base, "bound_weight", routed)
    return fast, slow, calls, never


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8) if t.is_floating_point() else t


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what


def _step(fast, slow, gen, tag):
    x = torch.randn(4, 3, 8, 8, generator=gen)
    outs = []
    for model in (fast, slow):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)))
        outs.append((y.detach(), xi.grad))
    _same(outs[0][0], outs[1][0], f"{tag}: output")
    _same(outs[0][1], outs[1][1], f"{tag}: grad x")
    for (name, p), q in zip(fast.named_parameters(), slow.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{tag}: grad of {name}"
        if p.grad is not None:
            _same(p.grad, q.grad, f"{tag}: grad {name}")
    for (name, b), c in zip(fast.state_dict().items(), slow.state_dict().values()):
        _same(b, c, f"{tag}: buffer {name}")
    with torch.no_grad():  # an SGD step on both, so the next step starts from new weights
        for p, q in zip(fast.parameters(), slow.parameters()):
            if p.grad is not None:
                p.sub_(0.05 * p.grad)
                q.sub_(0.05 * q.grad)


def _steps(fast, slow, gen, tag, n=3):
    for i in range(n):
        _step(fast, slow, gen, f"{tag} step {i}")


def test_layers_bind_and_the_bound_steps_give_the_per_layer_bits(pair):
    fast, slow, calls, _ = pair
    gen = torch.Generator().manual_seed(0)
    _steps(fast, slow, gen, "bound", n=4)
    assert calls[0] == 4 * 3  # every layer, every step (the first call binds and computes)
    layers = [m for m in fast if isinstance(m, (QConvBn2d, QConv2d, QLinear))]
    assert len(layers) == 3 and all(isinstance(m.__dict__.get("_weight_bound"), BoundWeight) for m in layers)


def _layer(m, i):
    return [x for x in m if hasattr(x, "weight_quant")][i]


def _new_weight_storage(m):
    _layer(m, 1).weight.data = _layer(m, 1).weight.data.clone()


def _frozen_and_back(m):
    set_quantizer_state(m, "frozen")
    m(torch.linspace(-2, 2, 4 * 3 * 64).reshape(4, 3, 8, 8))
    set_quantizer_state(m, "quantize")


def _swap_observer(m):
    q = _layer(m, 1).weight_quant
    q.observer = copy.deepcopy(q.observer)


def _load_assign(m):
    m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True)


def _gamma_frozen(m):
    m[1].bn.weight.requires_grad_(False)


def _eval_and_back(m):
    m.eval()
    with torch.no_grad():
        m(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3)))
    m.train()


def _new_eps(m):
    m[2].bn.eps = 1e-3


def _running_var_replaced(m):
    m[0].bn.running_var = m[0].bn.running_var.clone() * 1.5


def _bn_frozen_and_back(m):
    m[1].freeze_bn(True)
    m(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(4)))
    m[1].freeze_bn(False)


def _zero_weight_row(m):  # a zero extreme: the C++ step declines, the per-layer code decides
    with torch.no_grad():
        _layer(m, 2).weight[0].zero_()


def _kernel_transposed(m):  # the same memory and shape, read in another order: not contiguous
    w = _layer(m, 0).weight
    w.data = w.data.transpose(2, 3)


def _weight_frozen(m):
    _layer(m, 0).weight.requires_grad_(False)


CHANGES = {"weight storage replaced": _new_weight_storage, "frozen and back": _frozen_and_back,
           "observer replaced": _swap_observer, "load_state_dict(assign=True)": _load_assign,
           "eval and back": _eval_and_back, "zero weight row": _zero_weight_row, "weight not trained": _weight_frozen,
           "kernel transposed in place": _kernel_transposed,
           "gamma not trained": _gamma_frozen, "BN eps": _new_eps, "running_var replaced": _running_var_replaced,
           "BN frozen and back": _bn_frozen_and_back}
BN_ONLY = ("gamma not trained", "BN eps", "running_var replaced", "BN frozen and back")


@pytest.mark.parametrize("pair,change", [(kind, change) for kind in MODELS for change in CHANGES
                                         if kind == "folded" or change not in BN_ONLY], indirect=["pair"])
def test_a_change_after_binding_gives_the_per_layer_bits(pair, change):
    fast, slow, _, _ = pair
    gen = torch.Generator().manual_seed(1)
    _steps(fast, slow, gen, "before", n=2)
    CHANGES[change](fast)
    CHANGES[change](slow)
    _steps(fast, slow, gen, change)


def test_copies_and_pickles_of_a_bound_model_write_their_own_buffers(pair):
    fast, slow, calls, never = pair
    gen = torch.Generator().manual_seed(2)
    _steps(fast, slow, gen, "before", n=2)
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(fast), torch.load(buf, weights_only=False)):
        before = copy.deepcopy(fast.state_dict())
        reference = copy.deepcopy(slow)
        never.update(id(m) for m in reference.modules())
        bound_before = calls[0]
        _steps(copied, reference, gen, "copy")
        assert calls[0] - bound_before == 3 * 3  # the copy binds its own tensors
        for k, v in fast.state_dict().items():  # the original's buffers are untouched
            _same(v, before[k], f"original {k} after the copy's steps")


def test_a_weight_quantizer_that_a_hook_watches_is_called_as_a_module_every_step(pair):
    fast, slow, calls, _ = pair
    gen = torch.Generator().manual_seed(3)
    _steps(fast, slow, gen, "before", n=1)
    seen = []
    plain = [m for m in fast if isinstance(m, (QConv2d, QLinear))]
    for m in plain:
        m.weight_quant.register_forward_hook(lambda mod, inputs, out: seen.append(mod))
    bound = calls[0]
    _steps(fast, slow, gen, "watched", n=2)
    assert len(seen) == 2 * len(plain)  # the plain layers' quantizers ran as modules (folded ones never do)
    assert calls[0] - bound == 2 * (3 - len(plain))


def _float64_fake_quantize(w, scale, qmin, qmax):
    """``clamp(round_half_even(w / s), qmin, qmax) * s`` per output row and its clip mask, from
    float64: ``w / s`` in float64 rounded once to float32 is the float32 division (double rounding
    is innocuous for division), and ``code * s`` is exact in float64 before its one rounding."""
    s = scale.double().reshape(-1, *([1] * (w.dim() - 1)))
    r = torch.round((w.double() / s).float().double())  # torch.round: half to even
    keep = (r >= qmin) & (r <= qmax)
    return (r.clamp(qmin, qmax) * s).float(), keep


def test_a_bound_plain_weight_is_the_float64_formula():
    """Independently of dal's per-layer route: the observer's running min / max, the symmetric
    scale ``max(-min(lo, 0), max(hi, 0)) / qmax`` (float64, rounded once), the codes and the
    straight-through gradient, step after step, for a bound QLinear."""
    torch.manual_seed(4)
    layer = _calibrated_linear()
    q = layer.weight_quant
    assert q.symmetric and q.fmt.signed and q.observer_name == "minmax"
    for step in range(3):
        w = layer.weight.detach().clone()
        lo0, hi0 = q.observer.min_val.clone(), q.observer.max_val.clone()
        x = torch.randn(5, 16)
        g = torch.randn(5, 6)
        y = layer(x)
        assert isinstance(layer.__dict__.get("_weight_bound"), BoundWeight), "the step took the bound route"
        y.backward(g)
        lo, hi = torch.minimum(lo0, w.amin(dim=1)), torch.maximum(hi0, w.amax(dim=1))
        _same(q.observer.min_val, lo, f"step {step} running min")
        _same(q.observer.max_val, hi, f"step {step} running max")
        scale = (torch.maximum(-lo.double().clamp(max=0), hi.double().clamp(min=0)) / q.qmax).float()
        _same(q.scale, scale, f"step {step} scale")
        wq, keep = _float64_fake_quantize(w, scale, q.qmin, q.qmax)
        y_ref = torch.nn.functional.linear(x, wq, layer.bias.detach())
        _same(y.detach(), y_ref, f"step {step} output")
        grad_ref = (g.t() @ x) * keep  # STE: the gradient of linear's weight, where the code is not clipped
        _same(layer.weight.grad, grad_ref, f"step {step} grad W")
        with torch.no_grad():
            layer.weight.sub_(0.5 * layer.weight.grad)  # large steps: the range moves, some codes clip
        layer.weight.grad = None


def _calibrated_linear():
    layer = QLinear.from_float(nn.Linear(16, 6), W_ONLY, "fc").train()
    set_quantizer_state(layer, "observe")
    with torch.no_grad():
        layer(torch.randn(4, 16))
    set_quantizer_state(layer, "quantize")
    return layer


def test_a_plain_weight_with_nothing_clipped_passes_its_gradient_through(monkeypatch):
    """A plain layer's bound backward is ``(g * m) * 1``: ``g`` itself where the mask is all ones
    (a symmetric min-max weight never clips), the C++ pass where a moving-average range lags and
    codes clip. Both against the per-layer route, bit for bit, and the passes counted."""
    import dal.nn.weight_bound as weight_bound
    passes, real_pass, real_bound = [0], weight_bound.fold_backward, base.bound_weight
    never = set()

    def counted(*args):
        passes[0] += 1
        return real_pass(*args)
    monkeypatch.setattr(weight_bound, "fold_backward", counted)
    monkeypatch.setattr(base, "bound_weight", lambda m: None if id(m) in never else real_bound(m))
    for observer, clips in (("minmax", False), ("moving_average", True)):
        spec = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel", observer=observer))
        torch.manual_seed(3)
        fast = QLinear.from_float(nn.Linear(16, 6), spec, "fc").train()
        set_quantizer_state(fast, "observe")
        with torch.no_grad():
            fast(torch.randn(4, 16))
        set_quantizer_state(fast, "quantize")
        slow = copy.deepcopy(fast)
        never.add(id(slow))
        passes[0] = 0
        gen = torch.Generator().manual_seed(5)
        for i in range(4):
            x, g = torch.randn(4, 16, generator=gen), torch.randn(4, 6, generator=gen)
            for layer in (fast, slow):
                layer.weight.grad = None
                layer(x).backward(g)
            assert isinstance(fast.__dict__.get("_weight_bound"), BoundWeight)
            _same(fast.weight.grad, slow.weight.grad, f"{observer} step {i}: grad W")
            with torch.no_grad():  # growing weights: a lagging moving-average range clips
                for layer in (fast, slow):
                    layer.weight.mul_(1.5).sub_(0.5 * layer.weight.grad)
        assert (passes[0] > 0) == clips, (observer, passes[0])
