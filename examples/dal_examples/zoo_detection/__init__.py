"""Detection and segmentation on MNIST scenes: fx-traceable models, host post-processing,
COCO mAP / mIoU evaluation and a plain training loop (used by bench/detection*.py and tests).

    from dal_examples.datasets.mnist_scenes import mnist_scenes
    from dal_examples.zoo_detection import DigitDetector, train_steps, evaluate, torch_runner
    train, test = mnist_scenes("train", 2000), mnist_scenes("test", 300)
    det = DigitDetector(); train_steps(det, train, "detect", 600)
    evaluate(torch_runner(det), test, "detect")      # {"map": ..., "map50": ...}
"""
from .heads import decode_detections, decode_segmentation, detection_loss, detection_targets, segmentation_loss
from .metrics import coco_ground_truth, coco_map, mean_iou
from .models import NUM_CLASSES, STRIDE, DigitDetector, DigitSegmenter, TinyFPN
from .train import evaluate, image_batches, torch_runner, train_steps

__all__ = ["DigitDetector", "DigitSegmenter", "TinyFPN", "NUM_CLASSES", "STRIDE", "decode_detections",
           "decode_segmentation", "detection_loss", "detection_targets", "segmentation_loss", "coco_ground_truth",
           "coco_map", "mean_iou", "evaluate", "image_batches", "torch_runner", "train_steps"]
