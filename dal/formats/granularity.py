"""Granularity: which elements of a tensor share one scale and zero point.

One idea covers all three cases: a tensor is cut into blocks along ``axis``.

* per tensor:  ``Granularity()``            — one block, scale shape ``()``
* per channel: ``Granularity(axis=a)``      — block size 1 along ``a``, scale shape ``(x.shape[a],)``
* per group:   ``Granularity(axis=a, block_size=g)`` — blocks of ``g`` consecutive elements along
  ``a``; the scale has x's rank with ``x.shape[a] // g`` along ``a`` (ONNX blocked quantization,
  opset 21: ``axis`` is the blocked dimension and every other dimension has its own scale).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Granularity:
    """Where scales change; see the module docstring. ``block_size`` 0 means per channel."""

    axis: Optional[int] = None
    block_size: int = 0

    def __post_init__(self):
        if self.axis is None and self.block_size:
            raise ValueError(f"block_size={self.block_size} needs an axis; per-tensor granularity has no blocks")
        if self.block_size < 0:
            raise ValueError(f"block_size={self.block_size} must be >= 0 (0 means per channel)")

    @property
    def kind(self) -> str:
        if self.axis is None:
            return "per_tensor"
        return "per_group" if self.block_size else "per_channel"

    def normalized_axis(self, ndim: int) -> Optional[int]:
        """The axis as a non-negative index into a tensor of rank ``ndim``; validates it."""
        if self.axis is None:
            return None
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"axis={self.axis} is out of range for a tensor of rank {ndim}")
        return self.axis % ndim

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the scale / zero-point tensor for an input of ``shape``."""
        axis = self.normalized_axis(len(shape))
        if axis is None:
            return ()
        if not self.block_size:
            return (int(shape[axis]),)
        if shape[axis] % self.block_size:
            raise ValueError(
                f"group size block_size={self.block_size} does not divide axis {axis} of length {shape[axis]}")
        return tuple(int(s) // self.block_size if d == axis else int(s) for d, s in enumerate(shape))

    def expand(self, param, shape: Sequence[int]):
        """Broadcastable view of a scale/zero-point tensor ``param`` against an input of ``shape``."""
        axis = self.normalized_axis(len(shape))
        if axis is None:
            return param
        if not self.block_size:
            view = [1] * len(shape)
            view[axis] = -1
            return param.reshape(view)
        return param.repeat_interleave(self.block_size, dim=axis)

    def reduce_dims(self, ndim: int) -> tuple[int, ...]:
        """Dims reduced to compute one statistic per scale (per tensor / per channel only)."""
        axis = self.normalized_axis(ndim)
        return tuple(d for d in range(ndim) if d != axis)

    def __str__(self) -> str:
        if self.axis is None:
            return "per_tensor"
        if not self.block_size:
            return f"per_channel(axis={self.axis})"
        return f"per_group(axis={self.axis}, size={self.block_size})"


PER_TENSOR = Granularity()


def per_channel(axis: int = 0) -> Granularity:
    return Granularity(axis=axis)


def per_group(axis: int, size: int) -> Granularity:
    if size <= 0:
        raise ValueError(f"group size={size} must be a positive integer")
    return Granularity(axis=axis, block_size=size)
