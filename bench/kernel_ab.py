"""In-process A/B of dal's ctypes kernels: this tree's build against another tree's, one QAT step.

Alternating processes cannot resolve a few milliseconds on this shared machine: its speed drifts
by more than that between two runs (bench/results/detection_speed.md, session 13). Here one
process holds the float model and two deep copies of the same QAT model, and runs their train
steps in turn; the copy labelled "other" runs with the fake-quant and FP16-island libraries built
from ``--other``'s C++ sources (``dal/formats/csrc``), loaded through this tree's own loaders,
so both copies share the drift. Both copies must end with the same state (the kernels may only
change speed): the script says whether they do.

    python bench/kernel_ab.py --other /path/to/other/checkout --model ssdlite --batch 2 --reps 21

``--other`` is any checkout or ``git archive`` of dal; only its two C++ files are read.
Printed: CPU-time medians per step, QAT / float for each build, and this tree's minus the other's.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time

import torch
import torchvision.models.detection as tvd

import dal
from dal.formats import island, native
from detection import torchvision_batch, train_step, warmed_detector  # bench/detection.py
from cpu import cpu_flags  # bench/cpu.py

MODELS = {  # as bench/detection.py builds them
    "ssdlite": lambda: tvd.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=11),
    "fcos": lambda: tvd.fcos_resnet50_fpn(weights=None, weights_backbone=None, num_classes=11, min_size=160,
                                          max_size=160),
}


def load_libraries(tree: str | None) -> tuple:
    """((fake-quant library, island library), why not): built from ``tree``'s sources, or this
    tree's (None); a library is None where it cannot be built, and ``why not`` says so."""
    if tree is None:
        return (native.library(), island.library()), f"{native.status()}; {island.status()}"
    csrc = os.path.join(tree, "dal", "formats", "csrc")
    (fq, why_fq), (isl, why_isl) = (native.load_library(os.path.join(csrc, "fake_quant.cpp")),
                                    island.load_library(os.path.join(csrc, "fp16_island.cpp")))
    return (fq, isl), f"{why_fq}; {why_isl}"


def use(libraries: tuple) -> None:
    """Route every later kernel lookup of this process to ``libraries``."""
    fq, isl = libraries
    native.library = functools.lru_cache(maxsize=1)(lambda: fq)
    island.library = functools.lru_cache(maxsize=1)(lambda: isl)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other checkout (its dal/formats/csrc is built)")
    ap.add_argument("--model", choices=sorted(MODELS), default="ssdlite")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args(argv)
    if args.reps < 1 or args.batch < 1:
        ap.error(f"--reps and --batch must be at least 1, got {args.reps} and {args.batch}")
    torch.set_num_threads(1)
    (mine, why_mine), (other, why_other) = load_libraries(None), load_libraries(os.path.abspath(args.other))
    if None in mine or None in other:
        print(f"a kernel did not load: this tree: {why_mine}; --other: {why_other}")
        return 1
    images, targets = torchvision_batch(args.batch)
    fl = warmed_detector(MODELS[args.model], images)
    qat = dal.prepare_qat(copy.deepcopy(fl), recipe="int8_balanced", hardware="a2000",
                          example_inputs=(torch.stack(images),))
    dal.calibrate(qat, [torch.stack(images)], num_batches=1, progress=False)
    models = {"float": (fl, mine), "this tree": (qat, mine), "other": (copy.deepcopy(qat), other)}
    steps = {k: (train_step(m, images, targets), libs) for k, (m, libs) in models.items()}
    cpu = {k: [] for k in steps}
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for k, (step, libs) in steps.items():
            use(libs)
            c0 = time.process_time()
            step()
            if rep:
                cpu[k].append(time.process_time() - c0)
    use(mine)
    ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    a, b = models["this tree"][0].state_dict(), models["other"][0].state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"CPU: {cpu_flags()}; {args.model}, batch {args.batch}, medians of {args.reps} interleaved steps (CPU time)")
    print(" | ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    print(f"QAT / float: this tree {ms['this tree'] / ms['float']:.3f}, other {ms['other'] / ms['float']:.3f}; "
          f"this tree - other = {ms['this tree'] - ms['other']:+.1f} ms; same state after the steps: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
