"""Argument checks shared by the public quantization functions: each error names the argument."""
from __future__ import annotations

import torch

from .granularity import Granularity
from .qformat import QFormat


def check_scale(scale: torch.Tensor, expected_shape: tuple[int, ...]) -> None:
    """Scale must be positive, finite, and shaped for the granularity (a scalar is accepted
    where one scale is expected)."""
    if scale.numel() and not bool(torch.isfinite(scale).all()):
        raise ValueError(f"scale must be finite; got scale={scale.flatten()[:8].tolist()}")
    if scale.numel() and not bool((scale > 0).all()):
        bad = scale[~(scale > 0)].flatten()[:8].tolist()
        raise ValueError(f"scale must be > 0; got scale values {bad}")
    if tuple(scale.shape) != tuple(expected_shape) and not (expected_shape == () and scale.numel() == 1):
        raise ValueError(f"scale has shape {tuple(scale.shape)} but the granularity needs {tuple(expected_shape)}")


def check_zero_point(zero_point: torch.Tensor, fmt: QFormat, qmin: float, qmax: float) -> None:
    """Zero point must be an integer code inside the format's range (always 0 for FP8)."""
    zp = zero_point.double()
    if fmt.is_float8:
        if zp.numel() and bool((zp != 0).any()):
            raise ValueError(f"zero_point must be 0 for {fmt.name}; got {zero_point.flatten()[:8].tolist()}")
        return
    if zp.numel() and not bool((zp == torch.round(zp)).all()):
        raise ValueError(f"zero_point must be integer; got zero_point={zero_point.flatten()[:8].tolist()}")
    if zp.numel() and bool(((zp < fmt.qmin) | (zp > fmt.qmax)).any()):
        raise ValueError(
            f"zero_point={zero_point.flatten()[:8].tolist()} is out of range for {fmt.name} "
            f"[{int(fmt.qmin)}, {int(fmt.qmax)}]")


def check_tensor(x: torch.Tensor, gran: Granularity) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor; got dtype={x.dtype}")
    gran.scale_shape(x.shape)  # validates axis and block size
