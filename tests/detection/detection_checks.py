"""The issue-15 checks on real torchvision models (random weights, small inputs), written once for
the tests and for the timing run (``python tests/detection/detection_checks.py``): prepare,
calibrate on the normalised batch, one QAT step with the model's own loss, export, dal.verify
layer by layer; on the a1000 either refused by path or prepared."""
from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import dal
from dal.prepare.boundary import npu_part
from dal.recipe.errors import RecipeError

DETECTORS = ("fcos_resnet50_fpn", "retinanet_resnet50_fpn_v2", "ssdlite320_mobilenet_v3_large",
             "fasterrcnn_mobilenet_v3_large_320_fpn")
SEGMENTERS = ("deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large", "fcn_resnet50")
SIZE = {"ssdlite320_mobilenet_v3_large": 320}  # SSDlite's transform has a fixed size


def build(name: str) -> torch.nn.Module:
    """The model with random weights, 3 classes and the smallest input its constructor allows."""
    from torchvision.models import detection, segmentation

    torch.manual_seed(0)
    if name in SEGMENTERS:
        return getattr(segmentation, name)(weights=None, weights_backbone=None, num_classes=3, aux_loss=False)
    small = {} if name in SIZE else {"min_size": 64, "max_size": 64}
    return getattr(detection, name)(weights=None, weights_backbone=None, num_classes=3, **small)


def settle_batchnorm(name: str, model, x: torch.Tensor) -> None:
    """Running BN statistics from one batch (cumulative average, momentum None), so that eval
    mode normalises: with the constructor's mean 0 / var 1, random-weight MobileNets shrink their
    activations to ~1e-17 in eval and calibration gives degenerate scales (see
    dal.export.bias_range)."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [(m, m.momentum) for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    part = model if name in SEGMENTERS else npu_part(model)
    part.train()
    with torch.no_grad():
        part(x)
    for m, momentum in saved:
        m.momentum = momentum
    model.eval()


def batch(name: str, model, n: int = 2) -> torch.Tensor:
    """A normalised batch as the NPU part takes it: the detector's own transform of random images."""
    g = torch.Generator().manual_seed(1)
    size = SIZE.get(name, 64)
    images = [torch.rand(3, size, size, generator=g) for _ in range(n)]
    if name in SEGMENTERS:
        return torch.stack(images)
    model.eval()
    with torch.no_grad():
        return model.transform(images)[0].tensors


def train_step(name: str, model) -> float:
    """One QAT step with the model's own loss (a detector's loss dict, or cross entropy)."""
    g = torch.Generator().manual_seed(2)
    size = SIZE.get(name, 64)
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if name in SEGMENTERS:
        x = torch.rand(2, 3, size, size, generator=g)
        loss = F.cross_entropy(model(x)["out"], torch.randint(0, 3, (2, size, size), generator=g))
    else:
        images = [torch.rand(3, size, size, generator=g) for _ in range(2)]
        s = size / 64
        targets = [{"boxes": torch.tensor([[8.0, 8.0, 40.0, 36.0]]) * s, "labels": torch.tensor([1])},
                   {"boxes": torch.tensor([[4.0, 20.0, 30.0, 60.0], [30.0, 2.0, 60.0, 30.0]]) * s,
                    "labels": torch.tensor([2, 1])}]
        loss = sum(model(images, targets).values())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


class DictValues(torch.nn.Module):
    """``tuple(model(x).values())``: the segmentation models return a dict."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return tuple(self.model(x).values())


def layer_figures(report, view: str = "layers_forced") -> tuple[int, int, float]:
    """(codes differing, codes compared, max LSB) of one layer-by-layer view of ``report``:
    ``layers_forced``, dal.npu against onnxruntime with each layer run from onnxruntime's
    quantized inputs; ``torch_layers``, the torch QAT model teacher-forced to dal.npu's codes,
    one row per call of each quantizer (a head shared by the levels has one per level)."""
    rows = list(getattr(report, view))
    return sum(r.differ for r in rows), sum(r.elements for r in rows), max((r.max_abs for r in rows), default=0.0)


def run_a2000(name: str, path: str) -> dict:
    """The whole flow on the a2000; returns the figures the test asserts and the timings."""
    t = {}
    model = build(name)
    x = batch(name, model)
    settle_batchnorm(name, model, x)
    t0 = time.perf_counter()
    model = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000",
                            example_inputs=(x,) if name in SEGMENTERS else None)
    t["prepare"] = time.perf_counter() - t0
    rows = dal.prepared(model).report.rows
    t0 = time.perf_counter()
    model.eval()
    dal.calibrate(model, [x])
    t["calibrate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = train_step(name, model)
    t["qat_step"] = time.perf_counter() - t0
    model.eval()
    t0 = time.perf_counter()
    proto = dal.export_onnx(model, (x[:1],), path)
    t["export"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # dal.verify reads tensor outputs: a segmenter's dict ({"out": ...}) is given as its values
    report = dal.verify(path, DictValues(model) if name in SEGMENTERS else npu_part(model), (x[:1],))
    t["verify"] = time.perf_counter() - t0
    return {"rows": rows, "loss": loss, "proto": proto, "report": report, "times": t}


def run_a1000(name: str) -> str:
    """``"refused: <first offender>"`` or ``"prepared"`` on the int8-only a1000."""
    model = build(name)
    x = batch(name, model)
    try:
        dal.prepare_qat(model, recipe="int8_balanced", hardware="a1000",
                        example_inputs=(x,) if name in SEGMENTERS else None)
    except RecipeError as err:
        lines = str(err).splitlines()
        return "refused: " + (lines[1] if len(lines) > 1 else lines[0]).strip()
    return "prepared"


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or DETECTORS + SEGMENTERS:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            out = run_a2000(name, os.path.join(d, "m.onnx"))
            a1000 = run_a1000(name)
            differ, total, worst = layer_figures(out["report"])
            t_differ, t_total, t_worst = out["report"].layer_by_layer()
            integer = out["report"].integer
            unrun = [r.name for r in out["rows"] if "cannot run" in r.detail]
            print(f"{name}: loss {out['loss']:.3f}; layer by layer {differ}/{total} codes differ, max {worst:g} LSB; "
                  f"(with torch-fed view {t_differ}/{t_total}, max {t_worst:g}); integer model: "
                  f"{'identical' if integer is not None and integer.identical else integer}; "
                  f"float ops a2000 cannot run: {len(unrun)}; a1000: {a1000}; times "
                  + ", ".join(f"{k} {v:.1f}s" for k, v in out["times"].items())
                  + f"; total {time.perf_counter() - t0:.1f}s", flush=True)
