"""Lift-Splat-style image-to-BEV for the ground-plane scenes: every camera feature pixel is
lifted to the ground point its centre's ray meets (the depth is known: the world is the plane
``Z = 0``) and splatted into that point's BEV cell by scatter-add (``index_add``), then each
cell is divided by how many feature pixels it received.

    bev[n, c, e] = w[e] * sum_{(k, p) -> e} feats[n, k, c, p]        w[e] = 1 / max(1, count[e])

Feature pixel ``p = (y, x)`` of the stride-2 feature map is image point ``(2 x + 1, 2 y + 1)``;
pixels whose ray misses the BEV grid (or the ground) go to a spare cell ``CELLS^2`` that is
dropped. Cells no pixel reaches stay 0 (far from every camera): the BEV head fills them.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from bev_model import bev_head, camera_backbone
from bev_scenes import CAMERAS, CELLS, EXTENT, IMAGE, camera, homography

STRIDE = 2


def splat_index() -> torch.Tensor:
    """(CAMERAS * (IMAGE / STRIDE)^2,) int64 destination cell ``i * CELLS + j`` of every feature
    pixel of every camera (camera-major, then row-major), ``CELLS^2`` where its ray misses."""
    side = IMAGE // STRIDE
    t = (np.arange(side) + 0.5) * STRIDE
    v, u = np.meshgrid(t, t, indexing="ij")
    out = []
    for k in range(CAMERAS):
        ray = np.stack([u, v, np.ones_like(u)], axis=-1) @ np.linalg.inv(homography(camera(k))).T
        with np.errstate(divide="ignore", invalid="ignore"):
            X, Y = ray[..., 0] / ray[..., 2], ray[..., 1] / ray[..., 2]
        j = np.floor((X + EXTENT) * CELLS / (2 * EXTENT))
        i = np.floor((Y + EXTENT) * CELLS / (2 * EXTENT))
        ok = (ray[..., 2] > 0) & (i >= 0) & (i < CELLS) & (j >= 0) & (j < CELLS)
        out.append(np.where(ok, i * CELLS + j, CELLS * CELLS).reshape(-1))
    return torch.tensor(np.concatenate(out), dtype=torch.int64)


class LiftSplatBEV(nn.Module):
    """Input (N, CAMERAS, IMAGE, IMAGE) camera images; output (N, NUM_CLASSES, CELLS, CELLS) logits
    (module doc; backbone and head as ``bev_model.GridSampleBEV``)."""

    def __init__(self, width: int = 32, head: int = 48):
        super().__init__()
        self.width = width
        self.backbone = camera_backbone(width)
        index = splat_index()
        count = torch.bincount(index, minlength=CELLS * CELLS + 1)[:CELLS * CELLS]
        self.register_buffer("index", index)
        self.register_buffer("weight", (1.0 / count.clamp(min=1).to(torch.float32)).reshape(1, 1, CELLS, CELLS))
        self.head = bev_head(width, head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        feats = self.backbone(images.reshape(n * CAMERAS, 1, IMAGE, IMAGE))
        side = feats.shape[-1]
        feats = feats.reshape(n, CAMERAS, self.width, side * side).permute(0, 2, 1, 3)
        feats = feats.reshape(n, self.width, CAMERAS * side * side)
        bev = feats.new_zeros(n, self.width, CELLS * CELLS + 1).index_add(2, self.index, feats)
        bev = bev[:, :, :CELLS * CELLS].reshape(n, self.width, CELLS, CELLS)
        return self.head(bev * self.weight)
