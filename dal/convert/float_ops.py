"""Float ops between integer groups, with the float semantics of export/SPEC.md ("Float
islands"), applied to the integer model's forward by a ``TorchFunctionMode``.

torch's float32 kernels do not promise one rounding: its pooling sums in float32 in its own
order, its transcendental functions are vectorised approximations. The contract the NPU
reference implements instead (written once in export/SPEC.md), and which these follow:

* GlobalAveragePool / ReduceMean / AveragePool: the sum in float64 rounded once to float32,
  then one float32 division by the element count;
* Sigmoid (and SiLU, exported as ``x * Sigmoid(x)``): ``1 / (1 + exp(-x))`` in float64, rounded
  once to float32 (the Mul in float32); Tanh: float64, rounded once;
* HardSigmoid / HardSwish: ``clip(x * float32(1/6) + 0.5, 0, 1)`` in float32 (times x in float32);
* everything else (Relu, Clip, Add, Mul, MaxPool, Flatten, Reshape, Concat, ...) is exact or
  one IEEE float32 operation, in torch as in numpy.

A float op used by the model but absent from this list runs as torch computes it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def mean_f64(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    """float32(sum_float64(x over dims)) / float32(count)  (ReduceMean, GlobalAveragePool)."""
    dims = tuple(d % x.ndim for d in dims)
    n = 1
    for d in dims:
        n *= x.shape[d]
    s = x.double().sum(dim=dims, keepdim=keepdim).float()
    return s / torch.tensor(float(n), dtype=torch.float32, device=x.device)


def _spatial(output_size) -> bool:
    if isinstance(output_size, int):
        return output_size == 1
    return all(v == 1 for v in output_size)


def _adaptive_avg(x, output_size):
    if x.dtype == torch.float32 and _spatial(output_size):
        return mean_f64(x, range(2, x.ndim), True)
    return None


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    if x.dtype != torch.float32 or dtype is not None or dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return mean_f64(x, dims, keepdim)


def _avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if x.dtype != torch.float32 or ceil_mode or divisor_override is not None:
        return None
    s = F.avg_pool2d(x.double(), kernel_size, stride, padding, False, True, 1).float()
    if count_include_pad or not padding:
        k = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        return s / torch.tensor(float(k[0] * k[1]), dtype=torch.float32, device=x.device)
    ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=torch.float64, device=x.device)
    cnt = F.avg_pool2d(ones, kernel_size, stride, padding, False, False, 1).float()
    return s / cnt


def sigmoid_f64(x):
    """float32(1 / (1 + exp(-x))) computed in float64."""
    if x.dtype != torch.float32:
        return None
    return torch.reciprocal(1.0 + torch.exp(-x.double())).float()


def tanh_f64(x):
    """float32(tanh(x)) computed in float64 (ONNX Tanh, export/SPEC.md §5a)."""
    if x.dtype != torch.float32:
        return None
    return torch.tanh(x.double()).float()


def _silu(x, inplace=False):
    s = sigmoid_f64(x)
    return None if s is None else x * s


def _hardsigmoid(x, inplace=False):
    if x.dtype != torch.float32:
        return None
    return torch.clamp(x * torch.tensor(1 / 6, dtype=torch.float32) + 0.5, 0.0, 1.0)


def _hardswish(x, inplace=False):
    h = _hardsigmoid(x)
    return None if h is None else x * h


_IMPL = {
    F.adaptive_avg_pool2d: _adaptive_avg, torch.mean: _mean, torch.Tensor.mean: _mean,
    F.avg_pool2d: _avg_pool2d, torch.sigmoid: sigmoid_f64, torch.Tensor.sigmoid: sigmoid_f64,
    F.silu: _silu, F.hardsigmoid: _hardsigmoid, F.hardswish: _hardswish,
    torch.tanh: tanh_f64, torch.Tensor.tanh: tanh_f64, F.tanh: tanh_f64,
}


class NPUFloatOps(TorchFunctionMode):
    """Replaces the functions above by their SPEC.md semantics (others run unchanged)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        impl = _IMPL.get(func)
        if impl is not None:
            try:
                out = impl(*args, **(kwargs or {}))
            except TypeError:  # an argument form not handled here: torch's own op
                out = None
            if out is not None:
                return out
        return func(*args, **(kwargs or {}))
