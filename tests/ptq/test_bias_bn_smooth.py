"""Bias correction, BatchNorm re-estimation and SmoothQuant migration (dal.ptq)."""
import copy

import torch
from torch import nn

import dal
from dal.ptq import bias_correction, reestimate_bn, smooth_quant
from ptq_helpers import W4A8_PER_CHANNEL, max_rel_diff, mnist_cnn, trained_depthwise


def _outputs_per_layer(model, names, x):
    """Each named layer's output (torch hooks, not dal code), in float64."""
    outs = {}
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, a, o, n=n: outs.__setitem__(n, o.detach().double()))
             for n in names]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return outs


def test_bias_correction_removes_the_mean_shift():
    net, calib, test = trained_depthwise(unequal=False)
    q = dal.prepare_qat(copy.deepcopy(net), recipe=W4A8_PER_CHANNEL, hardware="a2000",
                        example_inputs=(calib[0][0],))
    dal.calibrate(q, calib, progress=False)
    before = copy.deepcopy(q).eval()
    deltas = bias_correction(q, calib, progress=False)
    assert set(deltas) == {"features.0", "features.3", "features.6", "features.9", "features.12", "head"}
    x = torch.cat([b[0] for b in calib])
    names = list(deltas)
    ref = _outputs_per_layer(net, names, x)
    # Mean error per channel of the last conv's (post-ReLU) output and of the logits, before / after.
    for name in ("features.12", "head"):
        dims = (0, 2, 3) if ref[name].dim() == 4 else (0,)
        shift_before = (_outputs_per_layer(before, [name], x)[name] - ref[name]).mean(dims).abs().mean()
        shift_after = (_outputs_per_layer(q, [name], x)[name] - ref[name]).mean(dims).abs().mean()
        assert shift_after < 0.7 * shift_before, name


def test_reestimate_bn_matches_torch_cumulative_average():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))
    batches = [torch.randn(16, 3, 10, 10) * 2 + 1 for _ in range(5)]
    # Oracle: torch's own BN with momentum=None (cumulative average) over the same batches.
    oracle = copy.deepcopy(net)
    for m in oracle.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    oracle.train()
    with torch.no_grad():
        for x in batches:
            oracle(x)
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.fill_(5.0)  # stale statistics
    net.eval()
    names = reestimate_bn(net, batches, progress=False)
    assert names == ["1", "4"]
    assert not net.training and net[1].momentum == 0.1  # mode and momentum restored
    for a, b in ((net[1], oracle[1]), (net[4], oracle[4])):
        assert torch.allclose(a.running_mean, b.running_mean, atol=1e-6)
        assert torch.allclose(a.running_var, b.running_var, atol=1e-6)


def test_reestimate_bn_on_folded_qat_model_restores_accuracy():
    from ptq_helpers import accuracy

    sys_net, calib, test = _mnist_cnn()
    q = dal.prepare_qat(copy.deepcopy(sys_net), recipe=W4A8_PER_CHANNEL, hardware="a2000",
                        example_inputs=(calib[0][0],))
    dal.calibrate(q, calib, progress=False)
    good = accuracy(q, test)
    scales = {n: qq.scale.clone() for n, qq in dal.quantizer.quantizers(q)}
    for m in q.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_var.mul_(4.0)
            m.running_mean.add_(0.3)
    broken = accuracy(q, test)
    assert broken < good - 5
    reestimate_bn(q, calib, progress=False)
    # 128 calibration images, statistics of the quantized network: close to, not equal to, the original.
    assert accuracy(q, test) >= good - 3
    # No quantizer scale moved.
    assert all(torch.equal(qq.scale, scales[n]) for n, qq in dal.quantizer.quantizers(q))


def _mnist_cnn():
    return mnist_cnn()


class _Block(nn.Module):
    """LayerNorm feeding two linears (like a ViT's qkv), then an MLP fed by a second LayerNorm."""

    def __init__(self, d=32):
        super().__init__()
        self.ln1, self.q, self.k = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d)
        self.ln2, self.fc = nn.LayerNorm(d), nn.Linear(d, 4 * d)

    def forward(self, x):
        h = self.q(self.ln1(x)) * self.k(self.ln1(x)).sigmoid()
        return self.fc(self.ln2(x + h))


def test_smooth_quant_unchanged_function_and_smaller_int8_error():
    torch.manual_seed(0)
    blk = _Block().eval()
    with torch.no_grad():
        blk.ln1.weight[:3] = 40.0  # outlier channels after the LayerNorm, as in transformers
    xs = [torch.randn(8, 16, 32) for _ in range(4)]
    with torch.no_grad():
        ref = blk(xs[0])
        act_before = blk.ln1(xs[0])
    work = copy.deepcopy(blk)
    scales = smooth_quant(work, xs, progress=False)
    assert set(scales) == {"ln1", "ln2"}
    with torch.no_grad():
        assert max_rel_diff(work(xs[0]), ref) <= 1e-5
        act_after = work.ln1(xs[0])

    def int8_error(act, lin):
        # Per-tensor int8 activation, per-channel int8 weight (torch's own fake-quant ops).
        s = act.abs().max() / 127
        aq = torch.fake_quantize_per_tensor_affine(act, float(s), 0, -128, 127)
        ws = lin.weight.abs().amax(1) / 127
        wq = torch.fake_quantize_per_channel_affine(lin.weight, ws, torch.zeros(ws.shape, dtype=torch.int32), 0,
                                                    -128, 127)
        exact = act @ lin.weight.T
        return float((aq @ wq.T - exact).pow(2).mean() / exact.pow(2).mean())

    with torch.no_grad():
        assert int8_error(act_after, work.q) < 0.5 * int8_error(act_before, blk.q)


