"""dal::fold_factor against numpy (IEEE float32 steps, the square root correctly rounded through float64)
and against dal.formats.fold_factor (the eager QConvBn2d path), values and d gamma; opcheck."""
import numpy as np
import pytest
import torch

import dal.kernels as K
from dal.formats.fold_factor import fold_factor as eager_fold_factor
from dal.kernels.fold_factor import fold_factor_op, generic


def _inputs(n=37, seed=0):
    rng = np.random.default_rng(seed)
    gamma = rng.normal(0, 1, n).astype(np.float32)
    gamma[:3] = 0.0
    var = rng.uniform(0, 4, n).astype(np.float32)
    var[5] = 0.0
    return torch.from_numpy(gamma), torch.from_numpy(var)


def _np_oracle(gamma, var, eps, ones_for_zero):
    var_eps = np.asarray(var, np.float32) + np.float32(eps)
    std = np.sqrt(var_eps.astype(np.float64)).astype(np.float32)
    raw = (np.asarray(gamma, np.float32) / std) if gamma is not None else np.float32(1.0) / std
    return np.where(raw != 0, raw, np.float32(1.0)) if ones_for_zero else raw, std


@pytest.mark.parametrize("ones_for_zero", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_fold_factor_values_and_gradient(ones_for_zero, affine):
    gamma, var = _inputs()
    g = gamma.clone().requires_grad_() if affine else None
    f = K.fold_factor(g, var, 1e-5, ones_for_zero)
    expect, std = _np_oracle(gamma.numpy() if affine else None, var.numpy(), 1e-5, ones_for_zero)
    np.testing.assert_array_equal(f.detach().numpy(), expect)
    for a, b in zip(generic(g, var, 1e-5, ones_for_zero), fold_factor_op(g, var, 1e-5, ones_for_zero)):
        assert torch.equal(a, b)  # the generic path and the C++ one: f, std and keep
    g_ref = gamma.clone().requires_grad_() if affine else None
    f_ref = eager_fold_factor(g_ref, var, 1e-5, ones_for_zero)
    assert torch.equal(f_ref.detach(), f.detach())
    if affine:
        up = torch.randn(gamma.shape)
        f.backward(up)
        f_ref.backward(up)
        assert torch.equal(g.grad, g_ref.grad)
        keep = (gamma.numpy() / std != 0) if ones_for_zero else True
        np.testing.assert_array_equal(g.grad.numpy(), np.where(keep, up.numpy(), np.float32(0)) / std)


def test_opcheck_fold_factor():
    gamma, var = _inputs()
    for args in ((gamma.clone().requires_grad_(), var, 1e-5, True), (None, var, 1e-3, False),
                 (gamma.double(), var.double(), 1e-5, True)):
        torch.library.opcheck(torch.ops.dal.fold_factor.default, args)
