"""dal/convert/matmul_f64.py ``weight_kn``: a float-island Linear's weight converted once to the
float64 ``[K, N]`` C-contiguous array dal.npu's MatMul reads, kept until the weight changes.

Oracle: numpy's float64 matmul of ``float64(x)`` and ``float64(W).T`` made C-contiguous here (what
dal.npu computes, export/SPEC.md §5a), every bit of the float64 result compared.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dal.convert.matmul_f64 import matmul_f64, weight_kn


def oracle(x: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    return np.matmul(np.ascontiguousarray(x.numpy().astype(np.float64)),
                     np.ascontiguousarray(w.numpy().astype(np.float64).T))


def test_kept_weight_gives_every_bit_of_the_oracle_and_follows_changes():
    torch.manual_seed(0)
    owner = nn.Module()
    w = torch.randn(48, 80)
    x = torch.randn(3, 5, 80) * 1e3
    b1 = weight_kn(owner, w)
    assert b1.flags.c_contiguous and b1.dtype == np.float64 and b1.shape == (80, 48)
    assert weight_kn(owner, w) is b1  # converted once
    assert np.array_equal(matmul_f64(x, b1).numpy(), oracle(x, w))
    w.mul_(-0.25)  # changed in place: converted again
    b2 = weight_kn(owner, w)
    assert b2 is not b1 and np.array_equal(matmul_f64(x, b2).numpy(), oracle(x, w))
    w2 = torch.randn(48, 80)  # another weight (other storage) on the same owner
    assert np.array_equal(matmul_f64(x, weight_kn(owner, w2)).numpy(), oracle(x, w2))
