"""The evaluators, used for real: pycocotools' COCOeval on hand-made detections whose scores
follow from the COCO definition, torchmetrics' mIoU against a numpy confusion matrix, and the
host decoding fed the training targets (it must give back the ground-truth boxes)."""
import numpy as np
import pytest
import torch

from dal_examples.datasets.mnist_scenes import mnist_scenes
from dal_examples.zoo_detection import STRIDE, coco_map, decode_detections, detection_targets, mean_iou

GT_BOXES = [torch.tensor([[10.0, 10.0, 50.0, 50.0]]), torch.tensor([[0.0, 0.0, 20.0, 40.0], [40.0, 40.0, 80.0, 60.0]])]
GT_LABELS = [torch.tensor([3]), torch.tensor([1, 7])]


def _dets(boxes, labels):
    return [(b, torch.full((len(b),), 0.9), lab) for b, lab in zip(boxes, labels)]


def test_perfect_detections_score_100():
    r = coco_map(GT_BOXES, GT_LABELS, _dets(GT_BOXES, GT_LABELS), 96)
    assert r["map"] == pytest.approx(100.0) and r["map50"] == pytest.approx(100.0)


def test_shifted_boxes_pass_only_the_thresholds_below_their_iou():
    # Each box shifted right by 1/8 of its width: IoU = (7/8) / (9/8) = 0.778, which passes
    # the COCO thresholds 0.50, 0.55, ..., 0.75 (6 of 10) and fails 0.80 ... 0.95.
    shifted = []
    for b in GT_BOXES:
        d = (b[:, 2] - b[:, 0]) / 8
        shifted.append(b + torch.stack([d, torch.zeros_like(d), d, torch.zeros_like(d)], 1))
    r = coco_map(GT_BOXES, GT_LABELS, _dets(shifted, GT_LABELS), 96)
    assert r["map50"] == pytest.approx(100.0)
    assert r["map"] == pytest.approx(60.0)


def test_wrong_class_scores_zero_and_no_detections_score_zero():
    wrong = [(lab + 1) % 10 for lab in GT_LABELS]
    assert coco_map(GT_BOXES, GT_LABELS, _dets(GT_BOXES, wrong), 96)["map"] == pytest.approx(0.0)
    empty = [(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64))] * 2
    assert coco_map(GT_BOXES, GT_LABELS, empty, 96) == {"map": 0.0, "map50": 0.0}


def test_miou_matches_a_numpy_confusion_matrix():
    g = torch.Generator().manual_seed(0)
    gt = torch.randint(0, 11, (6, 16, 16), generator=g)
    pred = torch.where(torch.rand(6, 16, 16, generator=g) < 0.7, gt, torch.randint(0, 11, (6, 16, 16), generator=g))
    cm = np.zeros((11, 11))
    np.add.at(cm, (gt.numpy().ravel(), pred.numpy().ravel()), 1)
    tp = np.diag(cm)
    expect = 100 * np.mean(tp / (cm.sum(0) + cm.sum(1) - tp))
    assert mean_iou([pred[:4], pred[4:]], gt) == pytest.approx(expect, rel=1e-5)


def test_decoding_the_training_targets_gives_back_the_ground_truth():
    s = mnist_scenes("test", 24, seed=11)
    heat, ltrb, _ = detection_targets(s.boxes, s.labels, 96 // STRIDE)
    logits = torch.logit(heat.clamp(1e-6, 1 - 1e-6))
    dets = decode_detections(logits.numpy(), ltrb.numpy())  # numpy in, as from dal.npu
    r = coco_map(s.boxes, s.labels, dets, 96)
    # Two digits of one class with centres in one cell collapse to one peak; allow that.
    assert r["map50"] > 97.0 and r["map"] > 97.0
