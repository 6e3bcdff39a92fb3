"""GroupNorm and InstanceNorm in the integer model: what the exported ``InstanceNormalization``
(and GroupNorm's ``Mul`` / ``Add``) compute on the NPU (export/SPEC.md §5a), not torch's fused
float32 kernels.

torch exports ``F.group_norm(x, G, w, b, eps)`` as

    Reshape(x, [0, G, -1]) -> InstanceNormalization(scale=1, B=0, epsilon=float32(eps))
        -> Reshape(back) -> Mul(w) -> Add(b)

(``w`` / ``b`` absent: Mul by the constant 1.0, Add of 0.0), and ``F.instance_norm`` with input
statistics as one ``InstanceNormalization(x, w, b)``. The rule both integer engines implement:

    InstanceNormalization:  y = T((x - mean) / sqrt(var + epsilon) * scale + B)

mean and biased variance over the spatial axes of each (sample, channel), every operation in
float64 from the file's values (``epsilon`` the float32 attribute), rounded ONCE to ``T`` (x's
type); then GroupNorm's Mul and Add are one float32 operation each (two roundings, not a fused
multiply-add).

torch's float32 ``group_norm`` kernel computes the statistics in float32 and folds the affine into
``x * a + c`` per channel: on 256-channel, 32-group float16-valued inputs it is an ulp off that on
about half of the float32 outputs and, after the FP16 island's Cast to float16, on ~2.5e-4 of the
float16 values (measured here). An int8 quantizer reading the island then flips a code now and
then: in RetinaNet v2's head (Conv -> Fp16GroupNorm -> ReLU, four times per branch) the exact
value of one element was 1.716308522 (normalised 1.7162963, plus beta 1.2159e-05), float32
0x1.b75ffep+0 one ulp below the float16 midpoint 1.71630859375, so float16 1.7158 and code 111;
torch's kernel gave the midpoint itself, float16 1.7168 (ties to even) and code 112: 1 of 16384
codes at the next quantizer, 273 of 2.1M end to end.

With a float16-valued input (an FP16 island's input) the mean's float64 sum is exact in any order
(11-bit significands; n < 2^13 per group as in layernorm.py); the sum of squares is not, which
leaves SPEC.md §5a's residual float64 near-tie only.
"""
from __future__ import annotations

from typing import Optional

import torch

from .fp16_region import float32_value, to_dtype_once


def instance_norm_f64(x: torch.Tensor, scale: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                      eps: float) -> torch.Tensor:
    """ONNX ``InstanceNormalization`` (module doc): ``T((x - mean) / sqrt(var + float32(eps)) *
    scale + B)`` over axes ``2..``, in float64, rounded once to x's type; ``scale`` / ``bias``
    None: 1 / 0, as the export writes them.

    >>> x = torch.tensor([[[1.0, 2.0, 4.0]]])
    >>> instance_norm_f64(x, None, None, 0.0)
    tensor([[[-1.0690, -0.2673,  1.3363]]])
    """
    axes = tuple(range(2, x.ndim))
    n = 1
    for d in axes:
        n *= x.shape[d]
    x64 = x.double()
    # sum / n as numpy's mean (dal.npu) divides; the two-pass variance as dal.npu computes it
    mean = x64.sum(dim=axes, keepdim=True) / n
    d = x64 - mean
    var = (d * d).sum(dim=axes, keepdim=True) / n
    y = d / torch.sqrt(var + float32_value(eps))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if scale is not None:
        y = y * scale.double().reshape(shape)
    if bias is not None:
        y = y + bias.double().reshape(shape)
    return to_dtype_once(y, x.dtype)


def group_norm_onnx(x: torch.Tensor, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """``F.group_norm`` as torch exports it (module doc): the InstanceNormalization of the
    ``(N, G, -1)`` view rounded once, then ``* w`` and ``+ b`` each in x's type. Not float32 /
    float16, or an argument form this does not cover: None (torch's op)."""
    if x.dtype not in (torch.float32, torch.float16) or x.ndim < 2 or x.shape[1] % int(num_groups):
        return None
    y = instance_norm_f64(x.reshape(x.shape[0], int(num_groups), -1), None, None, eps).reshape(x.shape)
    shape = (-1,) + (1,) * (x.ndim - 2)
    one = torch.ones((), dtype=x.dtype, device=x.device)
    # the exported Mul and Add are there even without an affine (by 1.0 and 0.0): -0 + 0 is +0
    y = y * (one if weight is None else weight.to(x.dtype).reshape(shape))
    return y + (one * 0 if bias is None else bias.to(x.dtype).reshape(shape))


def instance_norm_onnx(x: torch.Tensor, running_mean=None, running_var=None, weight=None, bias=None,
                       use_input_stats: bool = True, momentum: float = 0.1, eps: float = 1e-5):
    """``F.instance_norm`` with input statistics and no running ones (what export writes as one
    ``InstanceNormalization(x, w, b)``), by ``instance_norm_f64``. Other forms (running
    statistics: a BatchNormalization of the ``(1, N*C)`` view, or training): None (the caller
    decides)."""
    if not use_input_stats or running_mean is not None or running_var is not None \
            or x.dtype not in (torch.float32, torch.float16) or x.ndim < 3:
        return None
    return instance_norm_f64(x, weight, bias, eps)
