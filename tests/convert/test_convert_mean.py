"""Float means in dal.convert -- ``torch.mean`` / ``Tensor.mean`` (exported ReduceMean, timm's
``x.mean((2, 3))`` pooling), ``F.adaptive_avg_pool2d(x, 1)`` (GlobalAveragePool) and
``F.avg_pool2d`` (AveragePool) -- by export/SPEC.md §5a: ``T(sum float64(x) / n)``, rounded once
to the input type T (float32 or float16), as dal.npu computes the nodes.

Judged by the exact rational oracle of tests/mean_cases.py on tie cases that a second rounding
gets wrong (before, dal.convert rounded the sum to float32 and divided in float32: an ulp off on
every float32 tie case here), and on a small model with all three by dal.npu on every element.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from convert_common import assert_bit_exact, build, random_batches
from dal.convert.float_ops import NPUFloatOps
from mean_cases import exact_mean, rounded_twice, tie_case

torch.set_num_threads(1)

DIMS = [((2, 3, 2, 5), (1,), True), ((2, 5, 3), (2,), False), ((2, 3, 1, 4), (1, 2), True),
        ((3, 1, 2), (-3, 1), False), ((2, 4, 2, 8), (1,), True), ((2, 4, 2, 8), (-1, 1), False)]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("shape,dims,keep", DIMS, ids=[f"{s}-dims{d}-keep{k}" for s, d, k in DIMS])
def test_mean_is_the_exact_mean_rounded_once(dtype, shape, dims, keep):
    x = tie_case(shape, dims, dtype, seed=7)
    t = torch.from_numpy(x)
    with NPUFloatOps():
        got = [torch.mean(t, dims, keep), t.mean(dim=dims, keepdim=keep)]
        if len(dims) == 1:
            got.append(t.mean(dims[0], keep))
    want = exact_mean(x, dims, keep)
    for g in got:
        assert g.dtype == t.dtype and g.shape == want.shape and np.array_equal(g.numpy(), want)
    n = int(np.prod([shape[d] for d in dims]))
    if n == 3:  # the old rule, the sum rounded to T then divided, is an ulp off everywhere here
        assert (rounded_twice(x, dims, x.dtype.type).reshape(-1) != want.reshape(-1)).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("hw", [(4, 4), (3, 1)])
def test_adaptive_avg_pool_is_the_exact_mean_rounded_once(dtype, hw):
    x = tie_case((2, 3) + hw, [2, 3], dtype, seed=8)
    with NPUFloatOps():
        got = F.adaptive_avg_pool2d(torch.from_numpy(x), 1)
    assert np.array_equal(got.numpy(), exact_mean(x, [2, 3]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("include_pad", [False, True])
def test_avg_pool_is_the_exact_window_mean_rounded_once(dtype, include_pad):
    for kh, kw in ((2, 2), (3, 1)):
        w = tie_case((2 * 3 * 3 * 3, kh * kw), [1], dtype, seed=9)
        x = np.ascontiguousarray(w.reshape(2, 3, 3, 3, kh, kw).transpose(0, 1, 2, 4, 3, 5).reshape(2, 3, 3 * kh, 3 * kw))
        with NPUFloatOps():
            got = F.avg_pool2d(torch.from_numpy(x), (kh, kw), count_include_pad=include_pad)
        assert np.array_equal(got.numpy().reshape(-1), exact_mean(w, [1], keepdims=False)), (kh, kw)


def test_mean_over_no_dims_is_left_to_torch():
    """torch's ``x.mean(dim=())`` means every dim: not the ReduceMean rule's business."""
    x = torch.arange(6.0).reshape(2, 3)
    with NPUFloatOps():
        assert x.mean(dim=()).item() == 2.5


class Means(nn.Module):
    """A conv, then timm's pooling spelling (``x.mean((2, 3), keepdim=True)``: ReduceMean), an
    average pool and a global one (GlobalAveragePool), summed, and a classifier."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.relu(self.conv(x))
        pooled = y.mean((2, 3), keepdim=True) + F.adaptive_avg_pool2d(F.avg_pool2d(y, 3, 1, 1), 1)
        return self.fc(torch.flatten(pooled, 1))


def test_means_in_a_model_bit_exact_with_the_npu():
    torch.manual_seed(0)
    qat, proto, sess = build(Means(), torch.randn(2, 3, 6, 6), "a2000")
    ops = [n.op_type for n in proto.graph.node]
    assert {"ReduceMean", "GlobalAveragePool", "AveragePool"} <= set(ops), ops
    assert_bit_exact(dal.convert(qat), proto, sess, random_batches((3, 3, 6, 6), n=3, scale=2.0), "means")


def test_float16_sum_rounds_once_too():
    """The same float64 -> float16 rounding serves ReduceSum: torch's own cast of the float64 sum
    goes through float32 and would round twice (1 + 2^-11 + 2^-24 -> 1 + 2^-11 -> 1.0)."""
    x = torch.tensor([1.0, 2.0 ** -11, 2.0 ** -24], dtype=torch.float16)
    with NPUFloatOps():
        got = x.sum()
    assert got.dtype == torch.float16 and got.item() == 1 + 2.0 ** -10
