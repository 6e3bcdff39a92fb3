"""A plain training loop and evaluation for the MNIST-scene models (the user's own loop: the
same code trains the float model and the QAT model dal.prepare_qat returned)."""
from __future__ import annotations

from typing import Callable

import torch

from ..datasets.mnist_scenes import Scenes, scene_batches
from .heads import decode_detections, decode_segmentation, detection_loss, segmentation_loss
from .metrics import coco_map, mean_iou


def train_steps(model, scenes: Scenes, task: str, steps: int, lr: float = 2e-3, batch_size: int = 32,
                seed: int = 0) -> float:
    """``steps`` Adam steps on ``scenes`` (task "detect" or "segment"); returns the last loss.

    Adam keeps the step size independent of the loss scale, which differs between the two tasks.
    """
    if task not in ("detect", "segment"):
        raise ValueError(f"train_steps: task={task!r}; use 'detect' or 'segment'")
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    loss = torch.zeros(())
    for images, idx in scene_batches(scenes, batch_size, seed=seed, steps=steps):
        out = model(images)
        if task == "detect":
            loss = detection_loss(out, [scenes.boxes[i] for i in idx], [scenes.labels[i] for i in idx])
        else:
            loss = segmentation_loss(out, scenes.masks[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())


def image_batches(scenes: Scenes, batch_size: int = 64):
    """The scenes' images in order, in batches (for calibration and evaluation)."""
    for start in range(0, len(scenes), batch_size):
        yield scenes.images[start:start + batch_size]


def evaluate(run: Callable, scenes: Scenes, task: str, batch_size: int = 64) -> dict:
    """Score ``run(images) -> raw outputs`` on ``scenes`` with the host post-processing.

    ``run`` is the torch model (in eval mode, under no_grad) or a wrapper around
    ``dal.npu.load(path).run``; both go through the same ``decode_*`` and the same evaluator.
    Detection: ``{"map", "map50"}`` (COCOeval); segmentation: ``{"miou"}`` (torchmetrics).
    """
    size = int(scenes.images.shape[-1])
    if task == "detect":
        dets = []
        for images in image_batches(scenes, batch_size):
            heat, ltrb = run(images)[:2]
            dets.extend(decode_detections(heat, ltrb))
        return coco_map(scenes.boxes, scenes.labels, dets, size)
    preds = [decode_segmentation(run(images)[0]) for images in image_batches(scenes, batch_size)]
    return {"miou": mean_iou(preds, scenes.masks)}


def torch_runner(model) -> Callable:
    """``images -> tuple of outputs`` of a torch model in eval mode, without autograd."""
    model.eval()

    def run(images):
        with torch.no_grad():
            out = model(images)
        return out if isinstance(out, (tuple, list)) else (out,)

    return run
