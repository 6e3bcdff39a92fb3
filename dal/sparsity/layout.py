"""Where the groups of M lie in a weight tensor, per module type.

The groups always run along the *reduction* dimension of the operator, i.e. the input
channels, because that is what a matrix engine accumulates over:

- ``nn.Linear`` weight ``[out, in]``: groups of M consecutive ``in`` elements of a row
  (axis 1).
- ``nn.ConvNd`` weight ``[out, in/groups, *k]``: groups of M consecutive INPUT CHANNELS at
  each fixed ``(out, *kernel position)`` (axis 1). This is the order in which an NHWC
  im2col / implicit-GEMM engine reduces: for one output pixel it walks the kernel window and,
  at each tap, a contiguous run of input channels. (It is *not* groups along ``kw``.)
- ``nn.ConvTransposeNd`` weight ``[in, out/groups, *k]``: the operator reduces over input
  channels, which are axis 0 of its weight; groups of M consecutive input channels at each
  ``(out, *kernel position)`` (axis 0). A group never straddles a conv group because
  ``in/groups`` must be a multiple of M.

Subclasses (dal's ``QLinear``, ``QConv2d``, ...) follow their torch base class.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["SPARSE_TYPES", "reduction_axis", "op_class", "reduction_group_length",
           "to_groups", "from_groups"]

#: Module types whose weight can carry an N:M mask (subclasses included).
SPARSE_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

_CONV_T = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def reduction_axis(module: nn.Module) -> int:
    """Axis of ``module.weight`` along which the groups of M run (see module docstring).

    >>> reduction_axis(nn.Linear(8, 4)), reduction_axis(nn.ConvTranspose2d(8, 4, 3))
    (1, 0)
    """
    if isinstance(module, _CONV_T):
        return 0
    if isinstance(module, SPARSE_TYPES):
        return 1
    raise TypeError(f"{type(module).__name__} is not a Linear / Conv / ConvTranspose module")


def op_class(module: nn.Module) -> str:
    """The operator class asked of a hardware model: ``"linear"``, ``"conv"`` or
    ``"conv_transpose"``."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, _CONV_T):
        return "conv_transpose"
    if isinstance(module, SPARSE_TYPES):
        return "conv"
    raise TypeError(f"{type(module).__name__} is not a Linear / Conv / ConvTranspose module")


def reduction_group_length(module: nn.Module) -> int:
    """Number of consecutive weights along the reduction axis that belong to one conv group
    (``in_features`` for Linear, ``in_channels / groups`` for convolutions). It must be a
    multiple of M for an N:M mask."""
    if isinstance(module, nn.Linear):
        return module.in_features
    return module.in_channels // module.groups


def to_groups(t: Tensor, axis: int, m: int) -> Tensor:
    """``t`` rearranged to ``[G, m]``: row ``g`` is one group of ``m`` consecutive elements
    along ``axis``. A view when ``axis`` is the last dimension of a contiguous tensor, else a
    copy. Inverse: :func:`from_groups`.
    """
    axis = axis % t.dim()
    if t.shape[axis] % m:
        raise ValueError(f"axis {axis} of a tensor of shape {tuple(t.shape)} has length "
                         f"{t.shape[axis]}, not a multiple of {m}")
    moved = t if axis == t.dim() - 1 else t.movedim(axis, -1)
    return moved.reshape(-1, m)


def from_groups(g: Tensor, shape: "torch.Size | tuple", axis: int) -> Tensor:
    """Inverse of :func:`to_groups`: a contiguous tensor of ``shape``."""
    shape = tuple(shape)
    axis = axis % len(shape)
    if axis == len(shape) - 1:
        return g.reshape(shape)
    moved_shape = shape[:axis] + shape[axis + 1:] + (shape[axis],)
    return g.reshape(moved_shape).movedim(-1, axis).contiguous()
