"""QConvBn2d training (BN not frozen) against the textbook formula, computed in float64.

Oracle, written out here independently of dal.nn (Krishnamoorthi 2018; torch.ao's QAT ConvBn):

    f    = gamma / sqrt(running_var + eps)
    z    = conv(x, fq_w(W * f)) / f + b
    out  = gamma * (z - mean(z)) / sqrt(var(z) + eps) + beta          batch statistics (biased var)
    running_mean <- (1 - m) running_mean + m mean(z)
    running_var  <- (1 - m) running_var  + m var_unbiased(z)         m = 1 / num_batches for momentum=None

with the straight-through estimator through fq_w (gradient passes where the code is not
clipped). Only fq_w(W * f) itself is taken from float32 (the weight quantizer's codes must be
the module's bit for bit); everything after it is float64, so the module (float32) must agree
to float32 rounding in the output, the gradients w.r.t. x, W, b, gamma, beta and the running
statistics, step after step, whichever of its two equivalent routes the module takes.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dal.formats import fake_quantize, per_channel
from dal.nn import QConvBn2d, QConvBnReLU2d, SimpleLayerSpec, SimpleTensorSpec
from dal.prepare.state import set_quantizer_state

W_ONLY = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel"))


def _make(act, bias, momentum, groups, seed):
    torch.manual_seed(seed)
    conv = nn.Conv2d(4, 6, 3, padding=1, stride=1 + groups % 2, groups=groups, bias=bias)
    bn = nn.BatchNorm2d(6, momentum=momentum)
    with torch.no_grad():
        sign = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])  # negative gamma flips sign(f)
        bn.weight.copy_(sign * torch.empty(6).uniform_(0.5, 1.5))
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    if act == "relu":
        return QConvBnReLU2d.from_float(conv, bn, W_ONLY, "c").train()
    return QConvBn2d.from_float(conv, bn, W_ONLY, "c", activation=act).train()


def _oracle(q, snap, x, grad_out, w_scale):
    """Output, gradients and new running statistics of one training step, from the parameters
    and buffers in ``snap`` (taken before the step)."""
    bn = q.bn
    qmin, qmax = q.weight_quant.qmin, q.weight_quant.qmax
    # fq_w(W * f) exactly as a float32 weight quantizer computes it, and its clip mask.
    f32 = snap["gamma"] / torch.sqrt(snap["running_var"] + bn.eps)
    wf32 = snap["weight"] * f32.reshape(-1, 1, 1, 1)
    s = w_scale.reshape(-1, 1, 1, 1)
    wq32 = fake_quantize(wf32, "int8", w_scale, None, per_channel(0))
    codes = torch.round(wf32 / s)
    keep = ((codes >= qmin) & (codes <= qmax)).double()

    d = {k: v.double().requires_grad_(k in ("weight", "bias", "gamma", "beta"))
         for k, v in snap.items() if isinstance(v, torch.Tensor)}
    x64 = x.double().requires_grad_()
    f = d["gamma"] / torch.sqrt(d["running_var"] + bn.eps)
    wf = d["weight"] * f.reshape(-1, 1, 1, 1)
    wq = wf * keep + (wq32.double() - wf * keep).detach()  # value fq_w(W f), gradient STE
    z = F.conv2d(x64, wq, None, q.stride, q.padding, q.dilation, q.groups) / f.reshape(1, -1, 1, 1)
    if "bias" in d:
        z = z + d["bias"].reshape(1, -1, 1, 1)
    mean = z.mean(dim=(0, 2, 3))
    var = z.var(dim=(0, 2, 3), unbiased=False)
    z.retain_grad()
    n = z.numel() // z.shape[1]
    out = (d["gamma"].reshape(1, -1, 1, 1) * (z - mean.reshape(1, -1, 1, 1)) / torch.sqrt(var + bn.eps).reshape(1, -1, 1, 1)
           + d["beta"].reshape(1, -1, 1, 1))
    if q.activation == "relu":
        out = torch.relu(out)
    elif q.activation == "relu6":
        out = torch.clamp(out, 0.0, 6.0)
    (out * grad_out.double()).sum().backward()
    m = 1.0 / float(snap["num_batches_tracked"] + 1) if bn.momentum is None else bn.momentum
    with torch.no_grad():
        rm = (1 - m) * d["running_mean"] + m * mean
        rv = (1 - m) * d["running_var"] + m * var * n / (n - 1)
    grads = {"x": x64.grad, **{k: d[k].grad for k in ("weight", "bias", "gamma", "beta") if k in d}}
    # d/db is a sum that cancels to 0 (BN removes a per-channel constant): its float32 rounding
    # is relative to the summed magnitudes, not to the (zero) result.
    grads["bias_scale"] = z.grad.abs().sum(dim=(0, 2, 3)).max()
    return out.detach(), grads, rm, rv


def _assert_close(got, ref, what, scale=None, rel=2e-5):
    """max |got - ref| <= rel * scale (default max |ref|): float32 rounding, relative to the tensor's scale."""
    err = (got.double() - ref).abs().max().item()
    bound = rel * float(ref.abs().max() if scale is None else scale)

    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("route", ["weight", "output"])
@pytest.mark.parametrize("act,bias,momentum,groups,weight_state", [
    (None, False, 0.1, 1, "quantize"),
    ("relu", True, 0.1, 2, "frozen"),
    (None, True, None, 1, "frozen"),
    ("relu", False, None, 2, "quantize"),
    ("relu6", False, 0.1, 1, "quantize"),
])
def test_training_step_matches_float64_formula(act, bias, momentum, groups, weight_state, route):
    q = _make(act, bias, momentum, groups, seed=10 + groups)
    # The 1/f goes on the weight or on the conv output, whichever is cheaper: check both.
    q._divide_output = lambda x: route == "output"
    set_quantizer_state(q, "observe")
    with torch.no_grad():
        q(torch.randn(4, 4, 8, 8))
    set_quantizer_state(q, weight_state)
    if weight_state == "frozen":  # a scale too small for the weights: some codes clip (STE mask)
        q.weight_quant.scale.mul_(0.8)
    opt = torch.optim.SGD(q.parameters(), lr=0.05)
    for step in range(4):
        snap = {"weight": q.weight.detach().clone(), "bias": None if q.bias is None else q.bias.detach().clone(),
                "gamma": q.bn.weight.detach().clone(), "beta": q.bn.bias.detach().clone(),
                "running_mean": q.bn.running_mean.clone(), "running_var": q.bn.running_var.clone(),
                "num_batches_tracked": int(q.bn.num_batches_tracked)}
        x = torch.randn(4, 4, 8, 8, requires_grad=True)
        opt.zero_grad()
        out = q(x)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        # The scale the forward used (a "quantize" minmax observer updates it before quantizing).
        ref, grads, rm, rv = _oracle(q, snap, x.detach(), grad_out, q.weight_quant.scale.detach().clone())
        tag = f"step {step}"
        _assert_close(out.detach(), ref, f"{tag} output")
        _assert_close(x.grad, grads["x"], f"{tag} grad x")
        _assert_close(q.weight.grad, grads["weight"], f"{tag} grad W")
        _assert_close(q.bn.weight.grad, grads["gamma"], f"{tag} grad gamma")
        _assert_close(q.bn.bias.grad, grads["beta"], f"{tag} grad beta")
        if bias:
            _assert_close(q.bias.grad, grads["bias"], f"{tag} grad b", grads["bias_scale"])
        _assert_close(q.bn.running_mean, rm, f"{tag} running_mean")
        _assert_close(q.bn.running_var, rv, f"{tag} running_var")
        assert int(q.bn.num_batches_tracked) == step + 2  # the calibration batch counted too
        opt.step()


def test_route_choice_follows_tensor_sizes():
    # The weight unless it is large against the output (QConvBn2d._divide_output: 32 * out + 2**19).
    early = QConvBn2d.from_float(nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), W_ONLY, "a")
    late = QConvBn2d.from_float(nn.Conv2d(512, 512, 3, padding=1, bias=False), nn.BatchNorm2d(512), W_ONLY, "b")
    strided = QConvBn2d.from_float(nn.Conv2d(512, 512, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(512),
                                   W_ONLY, "c")
    assert not early._divide_output(torch.empty(8, 64, 56, 56))
    assert not late._divide_output(torch.empty(8, 512, 7, 7))  # 2.36 M weights, 200 K outputs
    assert late._divide_output(torch.empty(2, 512, 5, 5))  # 26 K outputs
    assert late._divide_output(torch.empty(512, 7, 7))  # unbatched input: 25 K outputs
    assert not strided._divide_output(torch.empty(4, 512, 28, 28))  # 401 K outputs after the stride
    assert strided._divide_output(torch.empty(1, 512, 14, 14))  # 25 K outputs after the stride


@pytest.mark.parametrize("route", ["weight", "output"])
def test_zero_gamma_channels_train_finite_and_export_beta(route):
    """gamma = 0 on some channels (the zero-init of a residual block's last BN, timm's and
    torchvision's ``zero_init_residual``): f = gamma / std = 0 there, and ``fq(W f) / f`` was
    0 / 0. The step must stay finite, those channels' output is exactly beta (BN with gamma 0),
    gamma gets the float model's gradient sum(g * x_hat) there (float64 oracle: BN on the conv
    of the unfolded weight), and eval folds them to weight 0, bias beta."""
    q = _make(None, False, 0.1, 1, seed=3)
    q._divide_output = lambda x: route == "output"
    with torch.no_grad():
        q.bn.weight[[1, 4]] = 0.0
    set_quantizer_state(q, "observe")
    with torch.no_grad():
        q(torch.randn(4, 4, 8, 8))
    set_quantizer_state(q, "quantize")
    x = torch.randn(4, 4, 8, 8, requires_grad=True)
    out = q(x)
    g = torch.randn_like(out)
    out.backward(g)
    for name, t in (("output", out), ("grad x", x.grad), ("grad W", q.weight.grad), ("grad gamma", q.bn.weight.grad),
                    ("grad beta", q.bn.bias.grad)):
        assert torch.isfinite(t).all(), f"{name} is not finite"
    beta = q.bn.bias.detach()
    for c in (1, 4):
        assert torch.equal(out[:, c], torch.full_like(out[:, c], float(beta[c])))
        assert float(q.weight.grad[c].abs().max()) == 0.0  # gamma 0: the channel's conv has no effect
    # gamma's gradient on a zero channel: sum(g * x_hat), x_hat the batch-normalised conv output
    # of the per-channel fake-quantized weight (f = 1 there), in float64.
    wq = fake_quantize(q.weight.detach(), "int8", q.weight_quant.scale.detach(), None, per_channel(0))
    z = F.conv2d(x.detach().double(), wq.double(), None, q.stride, q.padding)
    xhat = (z - z.mean((0, 2, 3), keepdim=True)) / torch.sqrt(z.var((0, 2, 3), unbiased=False, keepdim=True) + q.bn.eps)
    want = (g.double() * xhat).sum((0, 2, 3))
    for c in (1, 4):
        _assert_close(q.bn.weight.grad[c:c + 1], want[c:c + 1], f"grad gamma[{c}]", rel=1e-4)
    w, b = (t.detach() for t in q.folded_weight_and_bias())
    assert float(w[[1, 4]].abs().max()) == 0.0 and torch.equal(b[[1, 4]], beta[[1, 4]])
