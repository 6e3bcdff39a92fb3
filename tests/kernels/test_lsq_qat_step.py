"""An LSQ recipe's eager QAT step (w4a8_lsq on MnistCNN: int4 / int8 weights per channel, uint8
LSQ+ activations) through dal::fake_quantize_lsq against the same step through the eager LSQ
function it replaced (dal.formats.fake_quantize(learnable=True), i.e. FakeQuantizeFunction, set per
quantizer here): outputs, loss and every gradient but the scales' and zero points' bit for bit;
each scale / zero-point gradient within the op's contract of the exact float64 sum of its float32
products (tests/kernels/lsq_oracle.py), and the replaced function's float32 sum within its own
float32 summation bound of that exact sum."""
import copy
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dal
from dal.formats import fake_quantize
from dal.kernels import lsq_grad_scale
from dal.quantizer import quantizers
from dal_examples.zoo import MnistCNN

from lsq_oracle import assert_within, exact_sums, lsq_terms


def _replaced_forward(self, x):
    """The eager LSQ forward before dal::fake_quantize_lsq: the same projection and g, FakeQuantizeFunction."""
    self.project_learned_qparams_()
    g = lsq_grad_scale(x.numel(), self.scale.numel(), self.qmax)
    return fake_quantize(x, self.fmt, self.scale, self.zero_point, self.granularity, self.narrow_range,
                         learnable=True, grad_scale=g, check=False)


def _record(model):
    """Per learnable quantizer: its input and its output's gradient of the next step."""
    seen = {}
    for name, q in quantizers(model):
        if q.learnable:
            def hook(mod, args, out, name=name):
                seen[name] = [args[0].detach().clone()]
                out.register_hook(lambda g: seen[name].append(g.detach().clone()))
            q.register_forward_hook(hook)
    return seen


def _expanded(q, t, shape):
    return np.asarray(q.granularity.expand(t.detach(), shape).expand(shape)) if q.granularity.axis is not None \
        else t.detach().numpy()


@pytest.mark.filterwarnings("ignore:calibrate")
def test_lsq_qat_step_is_the_replaced_step_within_the_contract():
    torch.manual_seed(0)
    x = torch.randn(4, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(width=4), recipe="w4a8_lsq", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [torch.randn(4, 1, 28, 28) for _ in range(2)], progress=False, bn_statistics="auto")
    model.train()
    old = copy.deepcopy(model)
    for _, q in quantizers(old):
        if q.learnable:
            q._learnable_forward = types.MethodType(_replaced_forward, q)
    seen = _record(model)
    y = torch.tensor([3, 1, 4, 1])
    outs = []
    for m in (model, old):
        out = m(x * 3)
        loss = F.cross_entropy(out, y)
        loss.backward()
        outs.append((out, loss))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    qparams = [n for n, _ in model.named_parameters() if n.endswith((".scale", ".zero_point"))]
    assert len(qparams) >= 8 and len(seen) >= 4
    for (n, p), (_, r) in zip(model.named_parameters(), old.named_parameters()):
        if n not in qparams and p.grad is not None:
            assert torch.equal(p.grad, r.grad), n
    qs = dict(quantizers(model))
    clipped = 0
    for name, (xin, g) in seen.items():
        q, shape = qs[name], xin.shape
        s, z = _expanded(q, q.scale, shape), _expanded(q, q.zero_point, shape)
        m, ts, tz = lsq_terms(q.fmt, xin.numpy(), s, z, g.numpy())
        clipped += int((~m).sum())
        groups = _expanded(q, torch.arange(q.scale.numel()).reshape(q.scale.shape), shape).astype(np.int64) \
            if q.granularity.axis is not None else np.zeros(shape, np.int64)
        gs = lsq_grad_scale(xin.numel(), q.scale.numel(), q.qmax)
        replaced = dict(quantizers(old))[name]
        for t, new, before, what in ((ts, q.scale.grad, replaced.scale.grad, "scale"),
                                     (tz, q.zero_point.grad, replaced.zero_point.grad, "zero_point")):
            if new is None:
                assert before is None, f"{name} {what}"
                continue
            want, bound = exact_sums(t, groups, gs)
            assert_within(new, want, bound, f"{name} d/d{what}")
            # float32 summation (any order): |error| <= (n - 1) 2^-24 sum|t| per group, times gs
            n_per = t.size // want.size
            f32 = np.array([np.abs(t.reshape(-1)[groups.reshape(-1) == k]).astype(np.float64).sum()
                            for k in range(want.size)]) * gs * n_per * 2.0 ** -24
            assert_within(before, want, bound + f32, f"{name} d/d{what}, replaced path")
    assert clipped > 0  # the clipped branch of the gradient is taken
