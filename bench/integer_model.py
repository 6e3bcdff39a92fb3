"""Benchmark: dal.convert's integer model vs the float model vs dal.npu, ResNet-18 (random
weights, BN statistics randomised, int8_balanced on a2000), batch 32, 3x224x224, ONE thread
each, the same inputs, interleaved repetitions, medians.

The integer model is also checked against dal.npu on that batch (every output element).
Targets (not asserted): integer model >= 0.5x the float model's throughput, >= 5x dal.npu's.
Writes bench/results/integer_model.md.

    .venv/bin/python bench/integer_model.py [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from cpu import cpu_flags  # bench/cpu.py
from results_file import write_result  # bench/results_file.py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def build(batch: int):
    import torchvision

    import dal
    import dal.npu
    from export_common import prepared, randomize_bn
    torch.manual_seed(0)
    float_model = torchvision.models.resnet18(weights=None).eval()
    randomize_bn(float_model)
    import copy
    qat = prepared(copy.deepcopy(float_model), torch.randn(2, 3, 224, 224), "int8_balanced", "a2000")
    proto = dal.export_onnx(qat, (torch.randn(1, 3, 224, 224),), dynamic_batch=True)
    return float_model, dal.convert(qat), dal.npu.load(proto, threads=1)


def main(reps: int = 3, batch: int = 32) -> str:
    torch.set_num_threads(1)
    float_model, int_model, sess = build(batch)
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    runs = {"float model (torch eager, float32)": lambda: float_model(x),
            "integer model (dal.convert)": lambda: int_model(x),
            "dal.npu (C++ reference)": lambda: sess.run({"input": x.numpy()})}
    with torch.no_grad():
        y_int = int_model(x)  # first call: the probe forward, not timed
        y_npu = sess.run({"input": x.numpy()})[0]
        float_model(x)
        times = {k: [] for k in runs}
        for _ in range(reps):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    differ = int((y_int.numpy() != y_npu).sum())
    f, i, n = (med[k] for k in runs)
    chunks = [len(lay.chunks) for lay in int_model._layers.values() if hasattr(lay, "chunks")]
    lines = [
        "# Integer model throughput (bench/integer_model.py)", "",
        f"ResNet-18, batch {batch}, 3x224x224, int8_balanced / a2000 (float requantizer), one thread each, "
        f"{reps} interleaved runs, medians. CPU flags: {cpu_flags()}. torch {torch.__version__}.", "",
        "| engine | s / batch | images / s |", "|---|---|---|",
        *[f"| {k} | {med[k]:.2f} | {batch / med[k]:.1f} |" for k in runs], "",
        f"- integer model / float model throughput: **{f / i:.2f}x** (target >= 0.5x)",
        f"- integer model / dal.npu throughput: **{n / i:.2f}x** (target >= 5x)",
        f"- integer model vs dal.npu on this batch: {differ} of {y_npu.size} output elements differ",
        f"- exact accumulation: float32 convolutions over code differences in channel chunks "
        f"(every partial sum an integer below 2^24); chunks per integer layer: {chunks}",
        f"- {int_model.summary().splitlines()[0]}",
        "- freshly allocated buffers per run (no THP tuning); the machine is shared, absolute times swing.",
    ]
    text = "\n".join(lines) + "\n"
    return write_result("integer_model.md", text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    print(main(a.reps, a.batch))
