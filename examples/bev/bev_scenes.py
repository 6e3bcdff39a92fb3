"""Multi-camera scenes of MNIST digits lying on a ground plane, rendered deterministically.

World: the ground plane ``Z = 0``, ``X`` right, ``Y`` forward, ``Z`` up, in metres. The BEV grid
covers ``[-EXTENT, EXTENT)^2`` (32 x 32 cells of 1 m); cell ``(i, j)`` (row, column) is
``X in [-16 + j, -15 + j)``, ``Y in [-16 + i, -15 + i)``.

Ground texture: a ``mnist_scenes`` canvas of ``TEXELS`` x ``TEXELS`` (128, 4 texels per cell)
with 1 to 3 real MNIST digits of 32 to 48 texels (8 to 12 cells), texel ``(r, c)`` covering
``X in [-16 + c/4, -16 + (c+1)/4)``, ``Y`` alike with ``r``; outside the texture the ground is 0.

Cameras: ``CAMERAS`` pinholes (4: one on each side, camera k turned by 90 k degrees about Z), each at
``HEIGHT`` m above the ground and ``DISTANCE`` m from the centre, looking at a point ``LOOK``
m in front of the centre on its own side, focal ``FOCAL`` px, ``IMAGE`` x ``IMAGE`` pixels,
principal point at the image centre. Image coordinates are continuous, pixel ``(v, u)`` (row,
column) covering ``[u, u+1) x [v, v+1)``. A ground point ``P = (X, Y, 0)`` lands at

    (u, v) = (f x / z + IMAGE/2, f y / z + IMAGE/2),   (x, y, z) = R (P - C)

with ``R`` the camera's rotation (rows: right, down, forward), ``C`` its centre; for points on the
plane this is the homography ``H = K [r1 r2 -R C]`` (:func:`homography`).

Rendering: each pixel is the mean of ``SUPERSAMPLE``^2 sub-pixel samples; a sample's ray meets
the ground at ``H^-1 (u, v, 1)`` and reads the texture bilinearly (float64, zeros outside);
a ray that does not meet the ground in front of the camera reads 0.

Targets per BEV cell: occupied where any of its 4 x 4 texels is a stroke texel (value > 0.5,
``mnist_scenes``' rule); class ``1 + digit`` of the digit owning most of those texels (ties:
the smaller digit), 0 where free.

Same arguments, same scenes: ``bev_scenes(split, n, seed)`` is a pure function; "train" scenes
use MNIST's training digits and "test" scenes its test digits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

CAMERAS = 4
IMAGE = 48
FOCAL = 36.0
HEIGHT = 24.0
DISTANCE = 18.0
LOOK = 2.0
EXTENT = 16.0
CELLS = 32
TEXELS = 128
SUPERSAMPLE = 2
NUM_CLASSES = 11  # free + 10 digits


@dataclass(frozen=True)
class Camera:
    """A pinhole camera: centre ``C`` (3,), rotation ``R`` (3, 3; rows right, down, forward), focal
    ``f`` in pixels, square images of ``size`` pixels with the principal point at their centre."""

    C: np.ndarray
    R: np.ndarray
    f: float
    size: int

    def project(self, P: np.ndarray) -> np.ndarray:
        """(u, v, z) of world points ``P`` (..., 3) in float64: image coordinates and depth."""
        p = (np.asarray(P, dtype=np.float64) - self.C) @ self.R.T
        z = p[..., 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            u = self.f * p[..., 0] / z + self.size / 2
            v = self.f * p[..., 1] / z + self.size / 2
        return np.stack([u, v, z], axis=-1)


def camera(k: int) -> Camera:
    """Camera ``k`` of ``CAMERAS``: camera 0 rotated about the Z axis by ``360 k / CAMERAS``
    degrees counterclockwise seen from above (camera 0 stands at -Y looking towards +Y)."""
    yaw = 2 * math.pi * k / CAMERAS
    back = np.array([math.sin(yaw), -math.cos(yaw)])  # camera 0 stands at -Y looking towards +Y
    C = np.array([back[0] * DISTANCE, back[1] * DISTANCE, HEIGHT])
    target = np.array([back[0] * LOOK, back[1] * LOOK, 0.0])
    fwd = target - C
    fwd /= np.linalg.norm(fwd)
    right = np.cross(fwd, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    down = np.cross(fwd, right)
    return Camera(C=C, R=np.stack([right, down, fwd]), f=FOCAL, size=IMAGE)


def homography(cam: Camera) -> np.ndarray:
    """``H`` (3, 3) float64 with ``(u w, v w, w) = H (X, Y, 1)`` for ground points (``w`` = depth)."""
    K = np.array([[cam.f, 0, cam.size / 2], [0, cam.f, cam.size / 2], [0, 0, 1.0]])
    return K @ np.stack([cam.R[:, 0], cam.R[:, 1], -cam.R @ cam.C], axis=1)


def bev_cell_centres() -> np.ndarray:
    """(CELLS, CELLS, 3) world points of the BEV cells' centres on the ground."""
    c = -EXTENT + (np.arange(CELLS) + 0.5) * (2 * EXTENT / CELLS)
    Y, X = np.meshgrid(c, c, indexing="ij")
    return np.stack([X, Y, np.zeros_like(X)], axis=-1)


def reference_grids() -> tuple[torch.Tensor, torch.Tensor]:
    """``(grid, seen)``: ``grid`` (CAMERAS, CELLS, CELLS, 2) float32, each BEV cell centre projected
    into each camera as ``F.grid_sample`` coordinates (``align_corners=False``: ``2 u / IMAGE - 1``);
    a cell a camera does not see (behind it or outside its image) gets ``-1.5`` on both axes,
    outside any image, so zeros padding reads 0 there. ``seen`` (CAMERAS, CELLS, CELLS) bool."""
    grids, seen = [], []
    for k in range(CAMERAS):
        uvz = camera(k).project(bev_cell_centres())
        vis = (uvz[..., 2] > 0) & (uvz[..., 0] >= 0) & (uvz[..., 0] < IMAGE) & (uvz[..., 1] >= 0) & (uvz[..., 1] < IMAGE)
        g = np.where(vis[..., None], 2 * uvz[..., :2] / IMAGE - 1, -1.5)
        grids.append(g)
        seen.append(vis)
    return torch.tensor(np.stack(grids), dtype=torch.float32), torch.tensor(np.stack(seen))


def render(textures: torch.Tensor, supersample: int = SUPERSAMPLE) -> torch.Tensor:
    """Camera images (N, CAMERAS, IMAGE, IMAGE) float32 of ground textures (N, 1, TEXELS, TEXELS)
    (module doc: ``supersample``^2 rays per pixel through ``H^-1``, bilinear texture reads in
    float64)."""
    s = supersample
    t = (np.arange(IMAGE * s) + 0.5) / s
    v, u = np.meshgrid(t, t, indexing="ij")
    pix = np.stack([u, v, np.ones_like(u)], axis=-1)
    tex = textures.to(torch.float64)
    views = []
    for k in range(CAMERAS):
        ray = pix @ np.linalg.inv(homography(camera(k))).T  # (X w', Y w', w')
        w = ray[..., 2]
        ok = w > 0  # H^-1 (u, v, 1) = (X, Y, 1) / depth: the ray meets the ground in front of the camera
        with np.errstate(divide="ignore", invalid="ignore"):
            X, Y = ray[..., 0] / w, ray[..., 1] / w
        g = np.where(ok[..., None], np.stack([X / EXTENT, Y / EXTENT], axis=-1), 4.0)
        g = np.nan_to_num(np.clip(g, -4.0, 4.0), nan=4.0)
        grid = torch.from_numpy(g)[None].expand(tex.shape[0], -1, -1, -1)
        img = F.grid_sample(tex, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        views.append(F.avg_pool2d(img, s)[:, 0])
    return torch.stack(views, dim=1).to(torch.float32)


def cell_targets(masks: torch.Tensor) -> torch.Tensor:
    """(N, CELLS, CELLS) int64 class per cell from texel masks (N, TEXELS, TEXELS) (0 free,
    1 + digit on strokes): the digit owning most stroke texels of the cell, 0 where none."""
    per = TEXELS // CELLS
    counts = F.avg_pool2d(F.one_hot(masks, NUM_CLASSES).permute(0, 3, 1, 2).to(torch.float32), per) * per * per
    digits = counts[:, 1:]
    best = digits.argmax(1) + 1
    return torch.where(digits.amax(1) > 0, best, torch.zeros_like(best))


@dataclass
class BEVScenes:
    """``images`` float32 (N, CAMERAS, IMAGE, IMAGE) in [0, 1]; ``targets`` int64 (N, CELLS,
    CELLS) (0 free, 1 + digit); ``textures`` float32 (N, 1, TEXELS, TEXELS) the ground."""

    images: torch.Tensor
    targets: torch.Tensor
    textures: torch.Tensor

    def __len__(self) -> int:
        return int(self.images.shape[0])


def bev_scenes(split: str = "train", n: int = 1000, seed: int = 0) -> BEVScenes:
    """``n`` scenes of ``split`` (module doc), rendered in batches of 256 (about a second per
    thousand scenes)."""
    from dal_examples.datasets.mnist_scenes import mnist_scenes

    ground = mnist_scenes(split, n, size=TEXELS, seed=seed, min_side=32, max_side=48, max_digits=3)
    images = torch.cat([render(ground.images[i:i + 256]) for i in range(0, n, 256)])
    return BEVScenes(images=images, targets=cell_targets(ground.masks), textures=ground.images)
