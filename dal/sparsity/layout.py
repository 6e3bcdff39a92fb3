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

import functools

import torch
from torch import Tensor, nn

__all__ = ["SPARSE_TYPES", "sparse_types", "weighted_types", "reduction_axis", "op_class", "reduction_group_length",
           "to_groups", "from_groups"]

@functools.cache
def _weighted() -> dict:
    """Float module type -> its hardware op class, for the op classes that reduce a weight against
    an activation input (roles ``weight`` and ``input``: linear, conv, conv_transpose; a 3-D conv
    is named conv / conv_transpose): the module types of dal's own ops (dal.ops, read through
    :func:`dal.hardware.op_classes.module_op_classes`), a type that subclasses another one left
    out (``isinstance`` against its base finds it)."""
    from ..hardware.op_classes import OP_CLASS_ROLES, dal_ops, module_op_classes

    classes = module_op_classes()
    found = {}
    for op in dal_ops():
        for t in op.modules:
            cls = classes.get(t.__name__)
            if cls is not None and {"weight", "input"} <= set(OP_CLASS_ROLES[cls]):
                found[t] = cls
    return {t: c for t, c in found.items() if not any(u is not t and issubclass(t, u) for u in found)}


def weighted_types(*op_classes: str) -> tuple:
    """The float module types (subclasses included through ``isinstance``) of the weighted ops of
    these hardware op classes (all of linear, conv, conv_transpose when none is given), e.g.
    ``weighted_types("conv")`` is (nn.Conv1d, nn.Conv2d, nn.Conv3d)."""
    return tuple(t for t, c in _weighted().items() if not op_classes or c in op_classes)


def sparse_types() -> tuple:
    """Module types whose weight can carry an N:M mask (subclasses included): nn.Linear,
    nn.Conv1d/2d/3d, nn.ConvTranspose1d/2d/3d (:func:`weighted_types`)."""
    return weighted_types()


def __getattr__(name: str):
    """``SPARSE_TYPES``: :func:`sparse_types`, derived from dal.ops when read."""
    if name == "SPARSE_TYPES":
        return sparse_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reduction_axis(module: nn.Module) -> int:
    """Axis of ``module.weight`` along which the groups of M run (see module docstring).

    >>> reduction_axis(nn.Linear(8, 4)), reduction_axis(nn.ConvTranspose2d(8, 4, 3))
    (1, 0)
    """
    if isinstance(module, weighted_types("conv_transpose")):
        return 0
    if isinstance(module, sparse_types()):
        return 1
    raise TypeError(f"{type(module).__name__} is not a Linear / Conv / ConvTranspose module")


def op_class(module: nn.Module) -> str:
    """The operator class asked of a hardware model: ``"linear"``, ``"conv"`` or
    ``"conv_transpose"``."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, weighted_types("conv_transpose")):
        return "conv_transpose"
    if isinstance(module, sparse_types()):
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
