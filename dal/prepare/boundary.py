"""The detector boundary: which part of a torchvision detector runs on the NPU.

A torchvision detector (FCOS, RetinaNet, SSD / SSDlite, Faster R-CNN) takes a list of images and
returns losses (train) or detections (eval); inside, ``transform`` resizes and normalises, and
box decoding, anchor matching and NMS follow the heads. Deployed, pre- and post-processing stay
on the host CPU in float; the NPU runs the part in between. :func:`npu_part` is that part as a
module: ``forward(x)`` takes the normalised batch tensor ``(B, 3, H, W)`` (what
``model.transform`` hands the backbone) and returns the raw head tensors:

* FCOS: ``cls_logits, bbox_regression, bbox_ctrness``; RetinaNet / SSD: ``cls_logits,
  bbox_regression`` (the heads' dict, in its order);
* Faster R-CNN: the FPN features (the RoI pooling of the second stage reads them on the host)
  then the RPN head's ``objectness_<level>`` and ``rpn_bbox_deltas_<level>``; the RoI box head
  runs after proposal selection (data-dependent) and is not in the file.

``dal.calibrate`` and ``dal.export_onnx`` route a detector through it; the user's training
(``losses = model(images, targets)``) and evaluation (``model(images)``) call the detector as
before. Segmentation models (tensor in, dict of tensors out) need no boundary: they export whole.
The contract is also in export/SPEC.md ("Detector boundary") and in the ONNX metadata
(``dal.boundary``).
"""
from __future__ import annotations

import json
from typing import Optional

import torch
from torch import nn

#: top-level children of a detector that run on the host (pre/post-processing, anchors, losses)
HOST_PARTS = ("transform", "anchor_generator", "roi_heads", "box_coder", "proposal_matcher")


def is_detector(model: nn.Module) -> bool:
    """A torchvision-style detector: a ``GeneralizedRCNNTransform`` and a ``backbone``, with a
    ``head`` (FCOS, RetinaNet, SSD) or an ``rpn`` (Faster / Mask R-CNN)."""
    transform = getattr(model, "transform", None)
    return (type(transform).__name__ == "GeneralizedRCNNTransform" and isinstance(model, nn.Module)
            and hasattr(model, "backbone") and (hasattr(model, "head") or hasattr(model, "rpn")))


def npu_paths(model: nn.Module) -> tuple[str, ...]:
    """Module paths (prefixes) of a detector that are inside the NPU part."""
    return ("backbone", "head") if hasattr(model, "head") else ("backbone", "rpn.head")


def inside(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


class NPUPart(nn.Module):
    """Backbone + heads of a detector: normalised batch tensor in, raw head tensors out. Holds
    the detector's own submodules under their own names (``backbone.body.conv1``), so quantizer
    paths in the export and in errors are the detector's."""

    def __init__(self, detector: nn.Module):
        super().__init__()
        self.backbone = detector.backbone
        self.two_stage = not hasattr(detector, "head")
        if self.two_stage:
            self.rpn = nn.Module()
            self.rpn.head = detector.rpn.head
        else:
            self.head = detector.head
        self.output_names: list[str] = []
        self.training = detector.training

    def forward(self, x: torch.Tensor):
        check_batch(x)
        feats = self.backbone(x)
        feats = feats if isinstance(feats, dict) else {"0": feats}
        if self.two_stage:
            objectness, deltas = self.rpn.head(list(feats.values()))
            self.output_names = ([f"feature_{k}" for k in feats] + [f"objectness_{i}" for i in range(len(objectness))]
                                 + [f"rpn_bbox_deltas_{i}" for i in range(len(deltas))])
            return (*feats.values(), *objectness, *deltas)
        out = self.head(list(feats.values()))
        self.output_names = list(out)
        return tuple(out.values())


def host_steps(model: nn.Module, plan: list) -> list:
    """The plan with every step of a detector outside its NPU part (``roi_heads``: Faster R-CNN's
    box head runs after the data-dependent proposal selection) made a float step on the host.

    Those modules are not in the exported file and ``dal.calibrate`` (which runs the NPU part)
    never feeds them, so quantizing them would train and evaluate with quantizers no data
    calibrated; they run in float on the host CPU, as deployed, and the hardware model does not
    apply to them. A plan of a model that is no detector is returned as is."""
    import dataclasses

    if not is_detector(model):
        return plan
    prefixes = npu_paths(model)
    why = "host side of the detector boundary: not in the exported file, runs in float on the host CPU"
    return [s if inside(s.path, prefixes) else
            dataclasses.replace(s, action="float", spec=None, float_op=None, built="", reason=why) for s in plan]


def npu_part(model: nn.Module) -> nn.Module:
    """The module that runs on the NPU: :class:`NPUPart` for a detector, else ``model`` itself."""
    return NPUPart(model) if is_detector(model) else model


def example_batch(model: nn.Module) -> torch.Tensor:
    """A zero batch ``(1, 3, S, S)`` at the detector's own input size (its transform's
    ``fixed_size`` or ``min_size``): one forward of the NPU part finds its call sites."""
    t = model.transform
    fixed = getattr(t, "fixed_size", None)
    h, w = fixed if fixed else (int(t.min_size[-1]), int(t.min_size[-1]))
    p = next(model.parameters(), None)
    return torch.zeros(1, 3, int(h), int(w), device=p.device if p is not None else None)


def check_batch(x, what: str = "the input of the detector's NPU part") -> None:
    """A normalised image batch: one float tensor ``(B, 3, H, W)``; anything else is a one-line
    ``ValueError`` naming what it got."""
    if isinstance(x, dict):
        raise ValueError(f"{what}: expected a normalised image batch tensor (B, 3, H, W), got a dict with keys "
                         f"{sorted(map(str, x))[:6]}: pass the images (e.g. input_fn=lambda b: ((b['image'],), {{}}))")
    if not torch.is_tensor(x):
        raise ValueError(f"{what}: expected a normalised image batch tensor (B, 3, H, W), got {type(x).__name__}: stack "
                         "the transformed images (model.transform(images)[0].tensors)")
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"{what}: expected a normalised float image batch of rank 4 (B, 3, H, W), got rank {x.dim()} "
                         f"shape {tuple(x.shape)} dtype {x.dtype}")


def check_detector_call(images, targets, training: bool) -> None:
    """The arguments of ``detector(images, targets)``: a list of 3-D images, and in training a
    list of one dict per image with ``boxes`` (float, ``[N, 4]``) and ``labels`` (int64, ``[N]``).
    Raises a one-line ``ValueError`` naming the first thing that is wrong."""
    if torch.is_tensor(images):
        if images.dim() != 4:
            raise ValueError(f"detector images: expected a list of (3, H, W) tensors (or a (B, 3, H, W) batch), got "
                             f"a tensor of rank {images.dim()} shape {tuple(images.shape)}")
    elif not isinstance(images, (list, tuple)):
        raise ValueError(f"detector images: expected a list of (3, H, W) tensors, got {type(images).__name__}")
    else:
        for i, img in enumerate(images):
            if not torch.is_tensor(img) or img.dim() != 3:
                got = f"rank {img.dim()} shape {tuple(img.shape)}" if torch.is_tensor(img) else type(img).__name__
                raise ValueError(f"detector images[{i}]: expected a (3, H, W) tensor, got {got}")
    if targets is None:
        return
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, dict) for t in targets):
        raise ValueError(f"detector targets: expected a list of dicts (one per image) with 'boxes' and 'labels', got "
                         f"{type(targets).__name__}" + (f" of {type(targets[0]).__name__}" if isinstance(
                             targets, (list, tuple)) and targets else ""))
    if len(targets) != len(images):
        raise ValueError(f"detector targets: {len(targets)} target dict(s) for {len(images)} image(s)")
    for i, t in enumerate(targets):
        _check_target(i, t)


def _check_target(i: int, t: dict) -> None:
    missing = [k for k in ("boxes", "labels") if k not in t]
    if missing:
        raise ValueError(f"detector targets[{i}]: missing key(s) {missing} (has {sorted(t)})")
    boxes, labels = t["boxes"], t["labels"]
    if not torch.is_tensor(boxes) or boxes.dim() != 2 or boxes.shape[-1] != 4 or not boxes.is_floating_point():
        got = f"{tuple(boxes.shape)} {boxes.dtype}" if torch.is_tensor(boxes) else type(boxes).__name__
        raise ValueError(f"detector targets[{i}]['boxes']: expected a float tensor [N, 4] (x1, y1, x2, y2), got {got}")
    if not torch.is_tensor(labels) or labels.dim() != 1 or labels.dtype != torch.int64 \
            or labels.shape[0] != boxes.shape[0]:
        got = f"{tuple(labels.shape)} {labels.dtype}" if torch.is_tensor(labels) else type(labels).__name__
        raise ValueError(f"detector targets[{i}]['labels']: expected an int64 tensor [{boxes.shape[0]}] (one per "
                         f"box), got {got}")


def _pre_hook(module, args, kwargs):
    images = args[0] if args else kwargs.get("images")
    targets = args[1] if len(args) > 1 else kwargs.get("targets")
    check_detector_call(images, targets, module.training)
    return None


def guard(model: nn.Module) -> None:
    """Check every ``detector(images, targets)`` call's arguments (a forward pre-hook)."""
    model.register_forward_pre_hook(_pre_hook, with_kwargs=True)


def boundary_json(model: nn.Module, part: nn.Module) -> Optional[str]:
    """The ``dal.boundary`` metadata value of an exported detector, else None."""
    if not isinstance(part, NPUPart):
        return None
    return json.dumps({"model": type(model).__name__, "input": "normalised image batch (B, 3, H, W): the output of "
                       "model.transform (resize, then (x - image_mean) / image_std)",
                       "outputs": part.output_names, "npu": list(npu_paths(model)),
                       "host": [p for p in HOST_PARTS if hasattr(model, p)] + ["box decoding", "NMS"]})
