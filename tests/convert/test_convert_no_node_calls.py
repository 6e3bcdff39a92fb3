"""Calls the TorchScript exporter writes as no node (``Tensor.clone``, ``contiguous``, ``detach``,
an eval-mode dropout) between a convolution and the next one's quantizer: dal.npu sees
``DQ -> Conv -> Q`` and fuses it, so dal.convert's probe must read through the call and fuse the
layer too (probe.py ``_PASS``, the calls of the registry's ``identity`` and ``dropout`` ops).
``clone`` joined the probe's list when the list came from dal.ops; before, conv1 ran in float in
the integer model while dal.npu fused it."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from convert_common import assert_bit_exact, build, npu_fused_groups, random_batches

torch.set_num_threads(1)
SHAPE = (2, 3, 10, 10)

CALLS = {
    "Tensor.clone": lambda y: y.clone(),
    "Tensor.contiguous": lambda y: y.contiguous(),
    "F.dropout2d (eval)": lambda y: F.dropout2d(y, 0.5, training=False),
}


class TwoConvs(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.call = call

    def forward(self, x):
        return self.conv2(self.call(self.conv1(x)))


@pytest.mark.parametrize("call", list(CALLS))
def test_a_call_with_no_node_keeps_the_layer_one_integer_group_as_in_dal_npu(call):
    torch.manual_seed(0)
    qat, proto, sess = build(TwoConvs(CALLS[call]), torch.randn(SHAPE) * 2, "a2000")
    assert [n.op_type for n in proto.graph.node].count("Conv") == 2
    assert npu_fused_groups(sess) == 2
    im = dal.convert(qat)
    assert_bit_exact(im, proto, sess, random_batches(SHAPE, n=2, seed=3, scale=2.0), call)
    assert set(im.layer_forms().values()) == {"integer"}, im.layer_forms()
