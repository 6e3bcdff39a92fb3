"""COCO mAP (pycocotools' own COCOeval) and mIoU (torchmetrics) for the MNIST scenes.

Nothing here computes a precision/recall curve by hand: the ground truth and the detections
are handed to ``pycocotools.cocoeval.COCOeval`` as a COCO data set and result list, and the
segmentation confusion is accumulated by ``torchmetrics``' ``MulticlassJaccardIndex``.
"""
from __future__ import annotations

import contextlib
import io
from typing import Sequence

import torch

from .models import NUM_CLASSES


def coco_ground_truth(boxes: Sequence, labels: Sequence, size: int) -> dict:
    """A COCO-format data set dict: one image per scene (id = its index), one annotation per
    box (``bbox`` = [x, y, w, h], ``area`` = w h, ``category_id`` = digit + 1, ``iscrowd`` 0)."""
    images = [{"id": i, "width": size, "height": size} for i in range(len(boxes))]
    anns = []
    for i, (bx, lb) in enumerate(zip(boxes, labels)):
        for box, c in zip(bx.tolist(), lb.tolist()):
            w, h = box[2] - box[0], box[3] - box[1]
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": int(c) + 1, "iscrowd": 0,
                         "bbox": [box[0], box[1], w, h], "area": w * h})
    cats = [{"id": c + 1, "name": str(c)} for c in range(NUM_CLASSES)]
    return {"images": images, "annotations": anns, "categories": cats}


def coco_map(gt_boxes: Sequence, gt_labels: Sequence, detections: Sequence, size: int) -> dict:
    """``{"map": mAP@[.5:.95], "map50": mAP@.5}`` in percent, from pycocotools' COCOeval.

    ``detections[i]`` = (boxes [k, 4] xyxy, scores [k], labels [k]) for scene i (the output of
    ``decode_detections``). An empty result list scores 0 (COCO's loadRes refuses it).
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    results = []
    for i, (bx, sc, lb) in enumerate(detections):
        for box, s, c in zip(bx.tolist(), sc.tolist(), lb.tolist()):
            results.append({"image_id": i, "category_id": int(c) + 1, "score": float(s),
                            "bbox": [box[0], box[1], box[2] - box[0], box[3] - box[1]]})
    if not results:
        return {"map": 0.0, "map50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # COCO prints progress and its summary table
        gt = COCO()
        gt.dataset = coco_ground_truth(gt_boxes, gt_labels, size)
        gt.createIndex()
        ev = COCOeval(gt, gt.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {"map": 100.0 * float(ev.stats[0]), "map50": 100.0 * float(ev.stats[1])}


def mean_iou(pred_maps: Sequence, gt_masks, num_classes: int = NUM_CLASSES + 1) -> float:
    """mIoU in percent over ``num_classes`` (background included), from torchmetrics'
    ``MulticlassJaccardIndex`` accumulated over all pixels of all scenes (macro average:
    ``mean_c TP_c / (TP_c + FP_c + FN_c)``)."""
    from torchmetrics.classification import MulticlassJaccardIndex

    metric = MulticlassJaccardIndex(num_classes=num_classes, average="macro")
    start = 0
    for pred in pred_maps:
        pred = torch.as_tensor(pred)
        metric.update(pred, gt_masks[start:start + pred.shape[0]])
        start += pred.shape[0]
    return 100.0 * float(metric.compute())
