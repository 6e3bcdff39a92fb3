"""A hand-written BEV-style module, as a new user writes one (issue 44): a shared small CNN over
six camera feature maps, ``F.grid_sample`` of each camera onto a BEV grid from fixed reference
points, a multi-scale deformable-attention block in plain PyTorch as in Deformable-DETR's
reference code (``ms_deform_attn_core_pytorch``, a helper function, not a method; it and ``MSDeformAttn`` are
examples/bev/bev_deform.py's), the residual
``y = self.norm(query + self.attn(...))`` and a BEV conv head.

Neither forward traces with torch.fx (``B, N, C, H, W = x.shape`` unpacks a Proxy; the core
iterates over a tensor of level shapes), so prepare captures their functional ops by call site.
Tiny sizes: a forward is a few milliseconds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "bev"))
from bev_deform import MSDeformAttn, ms_deform_attn_core_pytorch  # noqa: E402,F401  (the one copy of each)

CAMERAS, IMG, BEV, D_MODEL = 6, 16, 8, 16


def _cnn(c_in, c_out, stride=1):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class BEVBlock(nn.Module):
    """Six cameras ``x`` (B, 6, 3, 16, 16) -> BEV logits (B, 4, 8, 8)."""

    def __init__(self, d_model=D_MODEL, n_levels=3):
        super().__init__()
        self.backbone = nn.Sequential(_cnn(3, 8), _cnn(8, d_model, 2))  # shared over the cameras
        g = torch.Generator().manual_seed(7)
        # fixed reference points: where each BEV cell lands in each camera's feature map
        self.register_buffer("cam_grids", torch.rand(CAMERAS, BEV, BEV, 2, generator=g) * 2.2 - 1.1)
        self.down = nn.ModuleList([_cnn(d_model, d_model, 2) for _ in range(n_levels - 1)])
        shapes = [(BEV >> i, BEV >> i) for i in range(n_levels)]
        self.register_buffer("spatial_shapes", torch.tensor(shapes, dtype=torch.long))
        c = (torch.arange(BEV, dtype=torch.float32) + 0.5) / BEV
        ref = torch.stack(torch.meshgrid(c, c, indexing="xy"), -1).reshape(1, BEV * BEV, 1, 2)
        self.register_buffer("reference_points", ref.expand(1, BEV * BEV, n_levels, 2).contiguous())
        self.attn = MSDeformAttn(d_model, n_levels)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Sequential(_cnn(d_model, d_model), nn.Conv2d(d_model, 4, 1))

    def forward(self, x):
        B, N, C, H, W = x.shape
        feats = self.backbone(x.flatten(0, 1)).unflatten(0, (B, N))
        bev = 0
        for cam in range(N):
            grid = self.cam_grids[cam].expand(B, BEV, BEV, 2)
            bev = bev + F.grid_sample(feats[:, cam], grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        levels = [bev]
        for down in self.down:
            levels.append(down(levels[-1]))
        value = torch.cat([lvl.flatten(2).transpose(1, 2) for lvl in levels], 1)
        query = bev.flatten(2).transpose(1, 2)
        ref = self.reference_points.expand(B, -1, -1, -1)
        y = self.norm(query + self.attn(query, ref, value, self.spatial_shapes))
        return self.head(y.transpose(1, 2).reshape(B, -1, BEV, BEV))
