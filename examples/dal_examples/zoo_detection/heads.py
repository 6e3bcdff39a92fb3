"""Training targets, losses and host-side decoding for the MNIST-scene detector and segmenter.

Decoding is the deployment's host code: it takes the raw head tensors (from torch or from the
NPU reference running the exported file, as numpy or torch) and does the same float work for
both: sigmoid, 3x3 peak picking, top-k, box assembly, class-wise NMS (torchvision.ops).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .models import NUM_CLASSES, STRIDE

TOP_K = 40
SCORE_MIN = 0.02
NMS_IOU = 0.5
BOX_NEIGHBOURS = 1  # box targets also at the cells within this distance of the centre cell


def detection_targets(boxes, labels, grid: int, num_classes: int = NUM_CLASSES):
    """Heatmap and box targets for one batch.

    ``heat[b, c]`` = max over digits of class c of ``exp(-d^2 / (2 sigma^2))``, d the distance
    (in cells) from a cell centre to the box centre, ``sigma = max(0.5, sqrt(w h) / (6 STRIDE))``;
    exactly 1 at the centre cell. ``ltrb[b, :, y, x]`` holds the distances (cells) from the
    centre of cell (x, y) to the box's left, top, right and bottom edges for the centre cell and
    its neighbours within ``BOX_NEIGHBOURS`` (``weight`` 1 there, 0 elsewhere).
    """
    b_n = len(boxes)
    heat = torch.zeros(b_n, num_classes, grid, grid)
    ltrb = torch.zeros(b_n, 4, grid, grid)
    weight = torch.zeros(b_n, 1, grid, grid)
    centres = (torch.arange(grid, dtype=torch.float32) + 0.5)
    for b, (bx, lb) in enumerate(zip(boxes, labels)):
        for box, c in zip(bx.tolist(), lb.tolist()):
            x0, y0, x1, y1 = (v / STRIDE for v in box)
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            sigma = max(0.5, ((x1 - x0) * (y1 - y0)) ** 0.5 / 6)
            g = torch.exp(-((centres[None, :] - cx) ** 2 + (centres[:, None] - cy) ** 2) / (2 * sigma ** 2))
            ix, iy = min(int(cx), grid - 1), min(int(cy), grid - 1)
            g[iy, ix] = 1.0
            heat[b, c] = torch.maximum(heat[b, c], g)
            for yy in range(max(0, iy - BOX_NEIGHBOURS), min(grid, iy + BOX_NEIGHBOURS + 1)):
                for xx in range(max(0, ix - BOX_NEIGHBOURS), min(grid, ix + BOX_NEIGHBOURS + 1)):
                    px, py = xx + 0.5, yy + 0.5
                    ltrb[b, :, yy, xx] = torch.tensor([px - x0, py - y0, x1 - px, y1 - py])
                    weight[b, 0, yy, xx] = 1.0
    return heat, ltrb, weight


def focal_loss(logits, target, alpha: float = 2.0, beta: float = 4.0):
    """CenterNet's penalty-reduced focal loss, summed and divided by the number of centres:
    ``-(1-p)^a log p`` at target 1, ``-(1-t)^b p^a log(1-p)`` elsewhere."""
    p = logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = target.eq(1).float()
    pos_loss = -(torch.log(p) * (1 - p) ** alpha * pos).sum()
    neg_loss = -(torch.log(1 - p) * p ** alpha * (1 - target) ** beta * (1 - pos)).sum()
    return (pos_loss + neg_loss) / pos.sum().clamp(min=1.0)


def detection_loss(outputs, boxes, labels):
    """Focal loss on the heatmap + L1 (cells) + GIoU on the boxes at the weighted cells."""
    from torchvision.ops import generalized_box_iou_loss

    heat_logits, ltrb_pred = outputs
    heat, ltrb, weight = detection_targets(boxes, labels, heat_logits.shape[-1], heat_logits.shape[1])
    loss = focal_loss(heat_logits, heat)
    sel = weight[:, 0] > 0
    if sel.any():
        pred = ltrb_pred.permute(0, 2, 3, 1)[sel]
        tgt = ltrb.permute(0, 2, 3, 1)[sel]
        l1 = (pred - tgt).abs().mean()
        # Boxes relative to the cell centre: (-l, -t, r, b).
        pb = torch.cat([-pred[:, :2], pred[:, 2:]], 1)
        tb = torch.cat([-tgt[:, :2], tgt[:, 2:]], 1)
        loss = loss + 0.1 * l1 + generalized_box_iou_loss(pb, tb, reduction="mean")
    return loss


def segmentation_loss(logits, masks):
    """Per-pixel cross-entropy over background + 10 digit classes."""
    return F.cross_entropy(logits, masks)


def _as_tensor(x):
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


@torch.no_grad()
def decode_detections(heat_logits, ltrb, top_k: int = TOP_K, score_min: float = SCORE_MIN, nms_iou: float = NMS_IOU):
    """Raw head tensors (torch or numpy, [B, C, G, G] and [B, 4, G, G]) -> per image
    ``(boxes [k, 4] xyxy pixels, scores [k], labels [k])``.

    score = sigmoid(logit) at cells that are the maximum of their 3x3 neighbourhood (per class);
    the ``top_k`` best above ``score_min`` are kept, their boxes built from ``ltrb`` (clamped at 0)
    around the cell centre, then ``torchvision.ops.batched_nms`` (IoU ``nms_iou``, per class).
    """
    from torchvision.ops import batched_nms

    heat = _as_tensor(heat_logits).float().sigmoid()
    ltrb = _as_tensor(ltrb).float().clamp(min=0)
    peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat)
    b_n, c_n, g_h, g_w = heat.shape
    out = []
    for b in range(b_n):
        scores, flat = peaks[b].reshape(-1).topk(min(top_k, peaks[b].numel()))
        keep = scores > score_min
        scores, flat = scores[keep], flat[keep]
        cls, cell = flat // (g_h * g_w), flat % (g_h * g_w)
        cy, cx = (cell // g_w).float() + 0.5, (cell % g_w).float() + 0.5
        d = ltrb[b].reshape(4, -1)[:, cell]
        boxes = torch.stack([cx - d[0], cy - d[1], cx + d[2], cy + d[3]], 1) * STRIDE
        kept = batched_nms(boxes, scores, cls, nms_iou)
        out.append((boxes[kept], scores[kept], cls[kept]))
    return out


@torch.no_grad()
def decode_segmentation(logits):
    """Raw logits [B, 11, S, S] (torch or numpy) -> class map [B, S, S] (argmax)."""
    return _as_tensor(logits).argmax(1)
