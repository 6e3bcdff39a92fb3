"""A small multi-camera BEV model: a shared CNN on every camera image, image-to-BEV by
``F.grid_sample`` at fixed reference points (each BEV cell centre projected into each camera by
its known homography, ``bev_scenes.reference_grids``), averaged over the cameras that see the
cell, and a BEV head giving per-cell logits over free + 10 digits.

    feats_k = CNN(image_k)                                   (N, C, 24, 24) per camera k
    bev     = sum_k grid_sample(feats_k, grid_k) * w         w = 1 / (cameras seeing the cell)
    logits  = head(bev)                                      (N, 11, 32, 32)

Occupancy is ``argmax != 0``; the digit class is the argmax (:func:`predict`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bev_scenes import CAMERAS, CELLS, IMAGE, NUM_CLASSES, reference_grids


def conv_bn_relu(cin: int, cout: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    """3x3 conv (padding keeps the size at stride 1) + BatchNorm + ReLU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, padding=dilation, dilation=dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


def camera_backbone(width: int) -> nn.Sequential:
    """The shared CNN: (M, 1, IMAGE, IMAGE) -> (M, width, IMAGE / 2, IMAGE / 2)."""
    return nn.Sequential(conv_bn_relu(1, 16), conv_bn_relu(16, width, stride=2), conv_bn_relu(width, width))


def bev_head(width: int, head: int) -> nn.Sequential:
    """The BEV head: (N, width, CELLS, CELLS) -> (N, NUM_CLASSES, CELLS, CELLS) logits; dilations
    1, 2, 4, 1 give each cell a 17-cell receptive field (a digit is 8 to 12 cells)."""
    return nn.Sequential(conv_bn_relu(width, head), conv_bn_relu(head, head, dilation=2),
                         conv_bn_relu(head, head, dilation=4), conv_bn_relu(head, head),
                         nn.Conv2d(head, NUM_CLASSES, 1))


class GridSampleBEV(nn.Module):
    """Input (N, CAMERAS, IMAGE, IMAGE) camera images; output (N, NUM_CLASSES, CELLS, CELLS) logits."""

    def __init__(self, width: int = 32, head: int = 48):
        super().__init__()
        self.width = width
        self.backbone = camera_backbone(width)
        grid, seen = reference_grids()
        self.register_buffer("grid", grid)  # (CAMERAS, CELLS, CELLS, 2)
        self.register_buffer("weight", (1.0 / seen.sum(0).clamp(min=1).to(torch.float32))[None, None])
        self.head = bev_head(width, head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        feats = self.backbone(images.reshape(n * CAMERAS, 1, IMAGE, IMAGE))
        grid = self.grid.repeat(n, 1, 1, 1)  # (N * CAMERAS, CELLS, CELLS, 2), camera fastest like feats
        views = F.grid_sample(feats, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        views = views.reshape(n, CAMERAS, self.width, CELLS, CELLS)
        bev = views[:, 0]
        for k in range(1, CAMERAS):
            bev = bev + views[:, k]
        return self.head(bev * self.weight)


def predict(logits: torch.Tensor) -> torch.Tensor:
    """(N, CELLS, CELLS) int64 class per cell (0 free, 1 + digit) from (N, NUM_CLASSES, CELLS, CELLS)."""
    return torch.as_tensor(logits).argmax(1)


def bev_metrics(pred: torch.Tensor, target: torch.Tensor) -> dict:
    """Scores in percent of predicted classes ``pred`` against ``target`` (both (N, CELLS, CELLS),
    0 free, 1 + digit), over all cells of all scenes together:

    * ``miou``: occupancy mIoU, the mean over {free, occupied} of |pred & gt| / |pred | gt|;
    * ``class_acc``: digit-class accuracy, the share of occupied cells (ground truth) whose
      predicted class is their digit (a cell predicted free counts as wrong).
    """
    occ_p, occ_t = pred != 0, target != 0
    ious = []
    for p, t in ((occ_p, occ_t), (~occ_p, ~occ_t)):
        union = int((p | t).sum())
        ious.append(int((p & t).sum()) / union if union else 1.0)
    n_occ = int(occ_t.sum())
    acc = int(((pred == target) & occ_t).sum()) / n_occ if n_occ else 1.0
    return {"miou": 100.0 * sum(ious) / 2, "class_acc": 100.0 * acc}
