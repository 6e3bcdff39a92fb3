"""The FP16 cast round trip of an FP16 island: torch's two casts (``x.to(float16).to(float32)``,
the path before) against the one-pass C++ kernel (dal.formats.fp_cast), interleaved in one
process, one thread, CPU time of this process (medians):

* per call of ``fake_quantize(x, "fp16")`` on a 1.6M-value float32 tensor that requires grad
  (the QAT case: an autograd node), forward only and forward + backward;
* SSDlite320 (MobileNetV3-Large: Hardswish / Hardsigmoid islands) QAT train step on the a2000,
  as bench/detection.py runs it (batch 2, 160x160, SGD), the kernel switched off and on in turn
  on the same model, with the float model's step as the peer (QAT / float).

    python bench/fp16_cast.py [--reps 5]        # writes bench/results/fp16_cast.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu import cpu_flags  # bench/cpu.py  # noqa: E402
from results_file import write_result  # bench/results_file.py  # noqa: E402
from timing import interleaved_times  # bench/timing.py  # noqa: E402


def _cpu_times(runs: dict, reps: int) -> dict:
    """CPU ms of each callable in each of ``reps`` interleaved repetitions (after one warm-up)."""
    return interleaved_times(runs, reps, clock=time.process_time, warmup=True)


def _cpu_medians(runs: dict, reps: int) -> dict:
    """Median CPU ms of each callable over ``reps`` interleaved repetitions."""
    return {k: statistics.median(v) for k, v in _cpu_times(runs, reps).items()}


def _switched(fn, on: bool):
    from dal.formats import fp_cast

    def run():
        previous = fp_cast.use_kernel(on)
        try:
            fn()
        finally:
            fp_cast.use_kernel(previous)
    return run


def per_call_lines(reps: int) -> list[str]:
    from dal.formats import fake_quantize
    x = (torch.randn(1_600_000) * 4).requires_grad_()
    g = torch.randn(1_600_000)

    def fwd():
        fake_quantize(x, "fp16")

    def fwd_bwd():  # autograd.grad: no accumulation into x.grad (a leaf's AccumulateGrad is no part of a model)
        torch.autograd.grad(fake_quantize(x, "fp16"), x, g)
    t = _cpu_medians({"torch fwd": _switched(fwd, False), "kernel fwd": _switched(fwd, True),
                      "torch fwd+bwd": _switched(fwd_bwd, False), "kernel fwd+bwd": _switched(fwd_bwd, True)}, reps)
    return ["| call | torch casts (ms) | kernel (ms) | kernel / torch |", "|---|---|---|---|",
            *(f"| {k} | {t['torch ' + k]:.3f} | {t['kernel ' + k]:.3f} | {t['kernel ' + k] / t['torch ' + k]:.2f}x |"
              for k in ("fwd", "fwd+bwd"))]


def ssdlite_lines(reps: int) -> list[str]:
    import torchvision

    import dal
    from detection import torchvision_batch, train_step  # bench/detection.py
    images, targets = torchvision_batch()

    def step_of(model):
        return train_step(model, images, targets)

    builder = torchvision.models.detection.ssdlite320_mobilenet_v3_large
    fl = builder(weights=None, weights_backbone=None)
    qat = dal.prepare_qat(builder(weights=None, weights_backbone=None), recipe="int8_balanced", hardware="a2000",
                          example_inputs=(torch.stack(images),))
    dal.calibrate(qat, [torch.stack(images)], num_batches=1, progress=False)
    islands = sum(1 for m in qat.modules() if getattr(m, "fp16_island", False))
    q = step_of(qat)
    times = _cpu_times({"float": step_of(fl), "torch casts": _switched(q, False), "kernel": _switched(q, True),
                        "clone": _floor(q, "clone"), "none": _floor(q, "none")}, reps)
    t = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(k - c for k, c in zip(times["kernel"], times["torch casts"]))
    acc_t, acc_k = {}, {}
    _cpu_times({"torch": _inside(q, False, acc_t), "kernel": _inside(q, True, acc_k)}, reps)
    inside = (f"Inside the round trips (forward), per step: {acc_k['calls']} calls, {acc_k['values'] / 1e6:.1f} M "
              f"values; torch casts {statistics.median(acc_t['ms'][1:]):.1f} ms, kernel "
              f"{statistics.median(acc_k['ms'][1:]):.1f} ms (medians of {reps} interleaved steps).")
    cols = ("torch casts", "kernel", "clone", "none")
    return [f"SSDlite320 train step, batch 2, 160x160, a2000 int8_balanced, {islands} FP16 islands; "
            f"medians of {reps} interleaved steps (CPU ms); QAT with the round trip by torch's casts, by the "
            "kernel, replaced by `x.clone()` (the floor of any round trip that returns a new tensor) and by "
            "nothing (`x` itself: the islands' casts gone, not a valid model):", "",
            "| float | " + " | ".join(f"QAT, {c}" for c in cols) + " | " + " | ".join(f"{c} / float" for c in cols)
            + " | kernel / torch casts |", "|---" * 10 + "|",
            f"| {t['float']:.0f} | " + " | ".join(f"{t[c]:.0f}" for c in cols) + " | "
            + " | ".join(f"{t[c] / t['float']:.3f}x" for c in cols) + f" | {t['kernel'] / t['torch casts']:.3f}x |",
            "", f"Kernel minus torch casts, median of the {reps} paired steps: {paired:+.1f} ms.", "", inside]


def _inside(fn, on: bool, acc: dict):
    """``fn`` with the kernel ``on`` / off, adding the CPU ms spent inside the FP16 round trips
    (functional.fake_quantize's calls of ``fp_cast_fake_quantize``, forward) and their count to ``acc``."""
    from dal.formats import functional
    inner = _switched(fn, on)

    def run():
        saved = functional.fp_cast_fake_quantize
        spent, calls, values = [0.0], [0], [0]

        def timed(x, dtype):
            c = time.process_time()
            y = saved(x, dtype)
            spent[0] += time.process_time() - c
            calls[0] += 1
            values[0] += x.numel()
            return y
        functional.fp_cast_fake_quantize = timed
        try:
            inner()
        finally:
            functional.fp_cast_fake_quantize = saved
        acc.setdefault("ms", []).append(spent[0] * 1e3)
        acc["calls"], acc["values"] = calls[0], values[0]
    return run


def _floor(fn, kind: str):
    """``fn`` with functional.fake_quantize's FP16 round trip replaced by ``x.clone()`` or ``x``."""
    from dal.formats import functional

    def run():
        saved = functional.fp_cast_fake_quantize
        functional.fp_cast_fake_quantize = (lambda x, d: x.clone()) if kind == "clone" else (lambda x, d: x)
        try:
            fn()
        finally:
            functional.fp_cast_fake_quantize = saved
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="train steps per variant (per-call: 10x as many)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from dal.formats import native
    native.library()
    head = [f"CPU: {cpu_flags()}; torch threads: 1; kernel: {native.status()}; "
            f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", ""]
    lines = head + ["Per call, `fake_quantize(x, \"fp16\")`, x: 1.6M float32 values requiring grad, "
                    f"medians of {10 * args.reps} interleaved calls:", ""]
    lines += per_call_lines(10 * args.reps)
    print("\n".join(lines), flush=True)
    tail = ["", *ssdlite_lines(args.reps), "",
            f"Load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}.", "",
            "Reading: on this shared machine a whole step moves by a few percent between runs, more than "
            "the round trips weigh; the time inside the round trips is the measure of the kernel. The "
            "kernel is memory-bound (one float32 read and one write per value) and lands on the `clone` "
            "floor; what stays between `clone` and `none` is the cost of a new tensor per call."]
    print("\n".join(tail))
    if not args.no_write:
        write_result("fp16_cast.md", "# FP16 cast round trip: torch casts vs the C++ kernel\n\n"
                     "`python bench/fp16_cast.py`\n\n" + "\n".join(lines + tail) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
