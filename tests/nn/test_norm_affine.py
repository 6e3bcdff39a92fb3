"""QBatchNorm2d's eager forward (a broadcast multiply-add) against torch's depthwise 1x1 conv,
the op the exporter traces and the NPU runs, and against float64; the traced graph holds the Conv."""
from __future__ import annotations


import onnx
import pytest
import torch
from torch import nn

import dal


class LoneBn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.conv = nn.Conv2d(c, 4, 3)

    def forward(self, x):
        return self.conv(self.bn(x))


def _prepared(c, seed):
    torch.manual_seed(seed)
    x = torch.randn(2, c, 9, 11) * 3 + 1
    q = dal.prepare_qat(LoneBn(c), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    return q, x


def _conv_reference(bn, x):
    """What the module computed before: the quantized operands through F.conv2d(groups=C)."""
    xq = bn.input_quant(x)
    a, b = bn.per_channel_affine(*bn._stats(xq))
    w = bn.quantized_weight(a.reshape(-1, 1, 1, 1))
    return bn.finish(torch.nn.functional.conv2d(xq, w, bn.quantized_bias(b), groups=x.shape[1]))


def _operands(bn, x):
    xq = bn.input_quant(x)
    a, b = bn.per_channel_affine(*bn._stats(xq))
    return xq, bn.quantized_weight(a.reshape(-1, 1, 1, 1)), bn.quantized_bias(b)


@pytest.mark.parametrize("c,seed,layout", [(3, 0, "nchw"), (16, 1, "nchw"), (64, 2, "channels_last"), (5, 3, "nchw")])
@pytest.mark.parametrize("train", [True, False])
def test_broadcast_forward_matches_the_depthwise_conv(c, seed, layout, train):
    """Forward: the broadcast and torch's conv are each the float64 product-plus-bias of the
    same quantized operands to float32 rounding (the conv rounds the product first on
    channels_last inputs, measured). Backward: dx bit for bit in eval."""
    q, x = _prepared(c, seed)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    q.train(train)
    bn = q.bn
    assert bn.output_quant is None and not bn.activation  # finish() is the identity here
    with dal.quantizer_states(q, "frozen"):  # the same operands on both routes (no observer step in between)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        mine, ref = bn(x1), _conv_reference(bn, x2)
        xq, w, bias = (t.detach() for t in _operands(bn, x))
        ref64 = xq.double() * w.double().reshape(1, -1, 1, 1) + bias.double().reshape(1, -1, 1, 1)
        # one rounding of each term at most (torch's kernels may or may not fuse the multiply-add)
        terms = (xq.double() * w.double().reshape(1, -1, 1, 1)).abs() + bias.double().abs().reshape(1, -1, 1, 1)
        for y in (mine, ref):
            assert bool(((y.double() - ref64).abs() <= torch.finfo(torch.float32).eps * terms).all())
        g = torch.randn_like(mine)
        mine.backward(g)
        ref.backward(g)
    if train:  # dx also flows through the batch statistics: sums in another order, float32 rounding apart
        torch.testing.assert_close(x1.grad, x2.grad)
        assert bn.weight.grad is not None
    else:  # running statistics: dx = g * w elementwise on both routes
        assert torch.equal(x1.grad, x2.grad)


def test_the_export_traces_the_depthwise_conv(tmp_path):
    q, x = _prepared(3, 0)
    path = tmp_path / "bn.onnx"
    dal.export_onnx(q.eval(), (x,), str(path))
    convs = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"]
    groups = [next((a.i for a in n.attribute if a.name == "group"), 1) for n in convs]
    assert 3 in groups, groups  # the BatchNorm as a depthwise 1x1 Conv, as before
