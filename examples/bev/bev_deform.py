"""BEVFormer-style image-to-BEV for the ground-plane scenes: the BEV queries start as
``bev_model.GridSampleBEV``'s features (each cell sampled at its projected centre, averaged over
the cameras that see it), then a multi-scale deformable attention (Deformable-DETR's ``MSDeformAttn``
and its pure-PyTorch core, the cameras as its levels) lets every cell sample each camera at a few
learned offsets around its reference point, weighted by a softmax; the result is added to the
queries and goes to the same BEV head.

    q   = GridSampleBEV's bev                                   (N, CELLS^2, C) queries
    out = MSDA(q, ref, feats of the 4 cameras)                  ref: the cells' projected centres
    logits = head(q + out)

dal recognises the core's pattern (``dal.prepare.deformable``): int8_balanced quantizes its
sampling arithmetic and attention-weighted sum in int16, int8_deform_fp16 keeps them (and the
grid_samples) in FP16.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bev_model import bev_head, camera_backbone
from bev_scenes import CAMERAS, CELLS, IMAGE, reference_grids


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    """Deformable-DETR's reference (models/ops/functions/ms_deform_attn_func.py, Apache-2.0)."""
    N_, S_, M_, D_ = value.shape
    _, Lq_, M_, L_, P_, _ = sampling_locations.shape
    value_list = value.split([H_ * W_ for H_, W_ in value_spatial_shapes], dim=1)
    sampling_grids = 2 * sampling_locations - 1
    sampling_value_list = []
    for lid_, (H_, W_) in enumerate(value_spatial_shapes):
        value_l_ = value_list[lid_].flatten(2).transpose(1, 2).reshape(N_ * M_, D_, H_, W_)
        sampling_grid_l_ = sampling_grids[:, :, :, lid_].transpose(1, 2).flatten(0, 1)
        sampling_value_l_ = F.grid_sample(value_l_, sampling_grid_l_,
                                          mode="bilinear", padding_mode="zeros", align_corners=False)
        sampling_value_list.append(sampling_value_l_)
    attention_weights = attention_weights.transpose(1, 2).reshape(N_ * M_, 1, Lq_, L_ * P_)
    output = (torch.stack(sampling_value_list, dim=-2).flatten(-2) * attention_weights).sum(-1).view(N_, M_ * D_, Lq_)
    return output.transpose(1, 2).contiguous()


class MSDeformAttn(nn.Module):
    """Deformable-DETR's ``MSDeformAttn`` (per-level 2-D reference points, no padding mask)."""

    def __init__(self, d_model: int, n_levels: int, n_heads: int = 2, n_points: int = 2):
        super().__init__()
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        with torch.no_grad():  # as Deformable-DETR's _reset_parameters: offsets start small
            self.sampling_offsets.weight.mul_(0.1)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes):
        N, Len_q, _ = query.shape
        N, Len_in, _ = input_flatten.shape
        value = self.value_proj(input_flatten).view(N, Len_in, self.n_heads, self.d_model // self.n_heads)
        sampling_offsets = self.sampling_offsets(query).view(N, Len_q, self.n_heads, self.n_levels, self.n_points, 2)
        attention_weights = self.attention_weights(query).view(N, Len_q, self.n_heads, self.n_levels * self.n_points)
        attention_weights = F.softmax(attention_weights, -1).view(N, Len_q, self.n_heads, self.n_levels, self.n_points)
        offset_normalizer = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]], -1)
        sampling_locations = reference_points[:, :, None, :, None, :] \
            + sampling_offsets / offset_normalizer[None, None, None, :, None, :]
        output = ms_deform_attn_core_pytorch(value, input_spatial_shapes, sampling_locations, attention_weights)
        return self.output_proj(output)


class DeformBEV(nn.Module):
    """Input (N, CAMERAS, IMAGE, IMAGE) camera images; output (N, NUM_CLASSES, CELLS, CELLS) logits
    (module doc; backbone and head as ``bev_model.GridSampleBEV``)."""

    def __init__(self, width: int = 32, head: int = 48):
        super().__init__()
        self.width = width
        self.backbone = camera_backbone(width)
        grid, seen = reference_grids()
        self.register_buffer("grid", grid)
        self.register_buffer("weight", (1.0 / seen.sum(0).clamp(min=1).to(torch.float32))[None, None])
        side = IMAGE // 2
        self.register_buffer("spatial_shapes", torch.tensor([(side, side)] * CAMERAS, dtype=torch.long))
        # the reference points in [0, 1] (MSDA's convention): (1, CELLS^2, CAMERAS, 2)
        self.register_buffer("reference_points", ((grid + 1) / 2).reshape(CAMERAS, CELLS * CELLS, 2).transpose(0, 1)[None])
        self.attn = MSDeformAttn(width, CAMERAS)
        self.head = bev_head(width, head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        feats = self.backbone(images.reshape(n * CAMERAS, 1, IMAGE, IMAGE))
        views = F.grid_sample(feats, self.grid.repeat(n, 1, 1, 1), mode="bilinear", padding_mode="zeros",
                              align_corners=False).reshape(n, CAMERAS, self.width, CELLS, CELLS)
        bev = views[:, 0]
        for k in range(1, CAMERAS):
            bev = bev + views[:, k]
        query = (bev * self.weight).flatten(2).transpose(1, 2)  # (N, CELLS^2, C)
        value = feats.reshape(n, CAMERAS, self.width, -1).permute(0, 1, 3, 2).reshape(n, -1, self.width)
        out = self.attn(query, self.reference_points.expand(n, -1, -1, -1), value, self.spatial_shapes)
        y = query + out
        return self.head(y.transpose(1, 2).reshape(n, self.width, CELLS, CELLS))
