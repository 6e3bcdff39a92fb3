"""Detector speed: one training step, dal INT8 QAT against float (target <= 1.25x), and the
exported QDQ detector run by dal.npu against onnxruntime (the ratio), all in one run.

- Train step: dal_examples.zoo_detection.DigitDetector (CenterNet-style FPN detector), batch 32 of
  96x96 MNIST scenes, its own loss (focal + L1 + GIoU, the target encoding included), Adam.
  Float and QAT steps are interleaved, medians of the repetitions. Then torchvision's FCOS
  (fcos_resnet50_fpn, the only FCOS torchvision builds) and SSDlite320 with
  ``losses = model(images, targets)`` if ``dal.prepare_qat`` prepares them (otherwise the line
  says why), at batch 2 and 8 (``--batches``): QAT adds a fixed cost per quantizer call, so at
  batch 2 it weighs ~4x more against the float step than at batch 8.
- Inference: the QAT detector exported with dal.export_onnx, batch 1 and batch 32, one thread
  each: dal.npu (integer semantics) against onnxruntime with full graph optimizations (its
  fused QLinearConv kernels, the deployed speed) and with optimizations off (the oracle).

Everything is read on the CPU time of this process (the machine is shared: the wall clock
also counts the waits for a core).

    python bench/detection.py --write bench/results/detection_speed.md
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch

import dal
from dal_examples.datasets.mnist_scenes import mnist_scenes
from dal.prepare import set_quantizer_state
from dal_examples.zoo_detection import DigitDetector, detection_loss, image_batches
from cpu import cpu_flags as _cpu_flags  # bench/cpu.py

TARGET = 1.25


def _interleaved(fns: dict, reps: int, cpu: bool = False, min_seconds: float = 0.0) -> dict:
    """Median seconds per call of each fn, the fns called in turn ``reps`` times (after one
    warm-up), and more rounds until the rounds took ``min_seconds`` in all: a fast line gets more
    samples, so its medians move less with the shared machine's noise (SSDlite's float step
    swung 251-366 ms within one run of 20). With ``cpu``, also the medians of this process's CPU
    time, as ``<name> cpu`` (on a shared machine the wall clock also counts the waits for a
    core), and every CPU time measured, as ``"cpu samples"`` (``<name> cpu`` -> list, in call
    order); ``"rounds"`` is how many rounds ran."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    cpus = {f"{k} cpu": [] for k in fns}
    start, rounds = time.perf_counter(), 0
    while rounds < reps or time.perf_counter() - start < min_seconds:
        rounds += 1
        for k, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[k].append(time.perf_counter() - t0)
            cpus[f"{k} cpu"].append(time.process_time() - c0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["rounds"] = rounds
    if cpu:
        out.update({k: statistics.median(v) for k, v in cpus.items()}, **{"cpu samples": cpus})
    return out


def step_ratio_quartiles(t: dict) -> tuple[float, float]:
    """First and third quartiles of QAT / float CPU time over the repetitions, each QAT step
    divided by the float step run just before it: how far the ratio moves within one run (the
    shared machine's speed drifts between repetitions, and neighbouring steps share the drift)."""
    samples = t["cpu samples"]
    pairs = [q / f for f, q in zip(samples["float cpu"], samples["qat cpu"])]
    if len(pairs) < 2:
        return pairs[0], pairs[0]
    q1, _, q3 = statistics.quantiles(pairs, n=4)
    return q1, q3


def _train_row(label: str, t: dict) -> str:
    wall, cpu = t["qat"] / t["float"], t["qat cpu"] / t["float cpu"]
    q1, q3 = step_ratio_quartiles(t)
    return (f"| {label} | {t['rounds']} | {1e3 * t['float']:.0f} | {1e3 * t['qat']:.0f} | {wall:.2f}x | "
            f"{1e3 * t['float cpu']:.0f} | {1e3 * t['qat cpu']:.0f} | {cpu:.2f}x | {q1:.2f}-{q3:.2f}x | "
            f"{'ok' if cpu <= TARGET else 'MISSED'} (<= {TARGET}x) |")


def _detector_step(model, images, boxes, labels):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()

    def step():
        loss = detection_loss(model(images), boxes, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def train_steps_line(scenes, reps, min_seconds=0.0):
    torch.manual_seed(0)
    images, boxes, labels = scenes.images[:32], scenes.boxes[:32], scenes.labels[:32]
    fl = DigitDetector()
    qat = dal.prepare_qat(DigitDetector(), recipe="int8_balanced", hardware="a2000", example_inputs=(images[:4],))
    dal.calibrate(qat, image_batches(scenes, 32), num_batches=2, progress=False)
    t = _interleaved({"float": _detector_step(fl, images, boxes, labels),
                      "qat": _detector_step(qat, images, boxes, labels)}, reps, cpu=True, min_seconds=min_seconds)
    return _train_row("DigitDetector, batch 32, 96x96", t), qat


def torchvision_batch(n: int = 2):
    """``n`` 160x160 images and one box each: the torchvision detectors' train-step input (seeded)."""
    torch.manual_seed(0)
    images = [torch.rand(3, 160, 160) for _ in range(n)]
    targets = [{"boxes": torch.tensor([[10.0, 20.0, 80.0, 90.0]]), "labels": torch.tensor([1])} for _ in range(n)]
    return images, targets


def train_step(model, images, targets):
    """One SGD step of a torchvision detector with its own loss, as a callable (model in train mode)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    model.train()

    def step():
        loss = sum(model(images, targets).values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def warmed_detector(builder, images):
    """``builder()`` from seed 0, its BatchNorm running statistics set to those of ``images``
    (one eval-mode forward with the BatchNorms in train mode and cumulative averaging).

    Why: a random-init network's default statistics (mean 0, variance 1) shrink MobileNetV3's
    activations in eval mode until SSDlite's head inputs are ~1e-16; calibration (eval mode)
    then gives scales that clip every value in training, 261 of SSDlite's 266 parameters get
    zero gradients, and the step timed is not one that trains. A user starts from pretrained
    weights, whose statistics describe the data: this is the closest a random model gets."""
    torch.manual_seed(0)
    model = builder().eval()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.no_grad():
        model(images)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    return model


def _torchvision_line(name, builder, reps, batch=2, size_note="160x160", min_seconds=0.0):
    """A torchvision detector's train step at ``batch`` images, float vs dal QAT (the same weights
    and BatchNorm statistics, ``warmed_detector``), or the reason it cannot be prepared."""
    images, targets = torchvision_batch(batch)
    size_note = f"batch {batch}, {size_note}"

    def step_of(model):
        return train_step(model, images, targets)

    fl = warmed_detector(builder, images)
    try:
        qat = dal.prepare_qat(copy.deepcopy(fl), recipe="int8_balanced", hardware="a2000",
                              example_inputs=(torch.stack(images),))
        dal.calibrate(qat, [torch.stack(images)], num_batches=1, progress=False)
        t = _interleaved({"float": step_of(fl), "qat": step_of(qat)}, reps, cpu=True, min_seconds=min_seconds)
    except Exception as err:  # noqa: BLE001 - the table says what is missing (another issue's work)
        return f"| {name}, {size_note} | - | - | - | - | - | - | - | - | not prepared: {type(err).__name__}: " \
               f"{str(err).splitlines()[0][:120]} |"
    return _train_row(f"{name}, {size_note}", t)


def inference_lines(qat, scenes, reps):
    import onnxruntime as ort

    import dal.npu

    set_quantizer_state(qat, "frozen")
    qat.eval()
    path = os.path.join(tempfile.mkdtemp(prefix="dal-detspeed-"), "det.onnx")
    dal.export_onnx(qat, (scenes.images[:4],), path, dynamic_batch=True)
    sess = dal.npu.load(path, threads=1)
    peers = {}
    for label, level in (("ort", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
                         ("ort_noopt", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = level
        peers[label] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    lines = []
    for batch in (1, 32):
        x = {"input": scenes.images[:batch].numpy()}
        n = 10 if batch == 1 else 1  # a batch-1 run is ~1 ms: time ten per repetition

        def runs(f):
            return lambda: [f() for _ in range(n)]
        t = _interleaved({"npu": runs(lambda: sess.run(x)),
                          **{k: runs(lambda s=s: s.run(None, x)) for k, s in peers.items()}}, reps, cpu=True)
        t = {k: t[f"{k} cpu"] / n for k in ("npu", "ort", "ort_noopt")}
        lines.append(f"| {batch} | {1e3 * t['npu']:.2f} | {1e3 * t['ort']:.2f} | {t['npu'] / t['ort']:.2f}x | "
                     f"{1e3 * t['ort_noopt']:.2f} | {t['npu'] / t['ort_noopt']:.2f}x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each line, at least")
    ap.add_argument("--min-seconds", type=float, default=20.0,
                    help="train-step lines repeat until their rounds took this long (more samples for fast lines)")
    ap.add_argument("--write", metavar="PATH", help="also write the markdown to PATH")
    ap.add_argument("--no-torchvision", action="store_true", help="skip the torchvision detectors")
    ap.add_argument("--train-only", action="store_true", help="skip the inference rows (no dal.npu build needed)")
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 8],
                    help="torchvision detector batch sizes (a step's Python cost is per call, not per image: "
                         "the ratio falls with the batch)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    torch.set_num_threads(1)
    scenes = mnist_scenes("test", 64)
    out = [f"CPU: {_cpu_flags()}; torch threads: {torch.get_num_threads()}; load average "
           f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; medians of at least {args.reps} "
           f"interleaved repetitions (train steps: as many rounds as fill {args.min_seconds:.0f} s); the machine is "
           "shared (absolute times swing 1.5-2x between runs, the ratios less).", "", "Train step (forward, loss, backward, Adam/SGD step), float vs dal QAT INT8 "
           "(int8_balanced, a2000), wall clock and CPU time of this process (the target is read on CPU time):", "",
           "| model | rounds | float (ms) | QAT (ms) | QAT / float | float CPU (ms) | QAT CPU (ms) | QAT / float CPU | "
           "per-step CPU ratio, quartiles | target |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    line, qat = train_steps_line(scenes, args.reps, args.min_seconds)
    out.append(line)
    if not args.no_torchvision:
        import torchvision.models.detection as tvd

        for batch in args.batches:
            out.append(_torchvision_line("torchvision fcos_resnet50_fpn", lambda: tvd.fcos_resnet50_fpn(
                weights=None, weights_backbone=None, num_classes=11, min_size=160, max_size=160), args.reps, batch,
                min_seconds=args.min_seconds))
            out.append(_torchvision_line("torchvision ssdlite320_mobilenet_v3_large",
                                         lambda: tvd.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None,
                                                                                   num_classes=11),
                                         args.reps, batch, "160x160 resized to 320x320 by its transform",
                                         args.min_seconds))
    out += ["", f"Load average after the train steps: {' '.join(f'{v:.2f}' for v in os.getloadavg())}."]
    if not args.train_only:
        out += ["", "Inference of the exported QAT DigitDetector (QDQ ONNX), one thread each, CPU time of this process "
                "per run (medians): dal.npu (integer semantics) vs onnxruntime with full optimizations (fused "
                "QLinearConv) and with optimizations off:", "",
                "| batch | dal.npu CPU (ms) | ORT CPU (ms) | npu / ORT | ORT no-opt CPU (ms) | npu / ORT no-opt |",
                "|---|---|---|---|---|---|"]
        out += inference_lines(qat, scenes, args.reps)
    text = "\n".join(out)
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
