"""One ResNet-18 training step (batch 8, 112x112 and 224x224): float vs dal INT8 QAT vs torch.ao eager QAT.

Prints medians of interleaved repetitions (float, dal, torch.ao, float, dal, ...) and the
ratios against the float step, in wall-clock time and in CPU time of this process
(``time.process_time``: on a machine shared with other jobs the wall clock also counts the
time this process waited for a core; CPU time does not), with the load average before and after.
Peer: torch.ao.quantization.prepare_qat with the x86 QAT qconfig on torchvision's quantizable
ResNet-18 (fused Conv+BN+ReLU), the reference QAT flow of PyTorch.

    python bench/qat_step.py --res 112 224 [--threads 1] [--write bench/results/qat_step.md]
    python bench/qat_step.py --compile [inductor] --res 112 --reps 3

``--compile BACKEND`` (default inductor): compiled float vs compiled dal QAT (``torch.compile`` of each
model; the quantizers run dal.kernels' ops), interleaved, no torch.ao column; the warm-up step
includes the compile.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
import torchvision
from cpu import cpu_flags as _cpu_flags  # bench/cpu.py


def _step_fn(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


#: the house issue's targets for dal / float, per resolution
TARGETS = {112: 1.25, 224: 1.12}


def _models(size: int, batch: int, backend: str | None = None):
    import dal

    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))
    float_model = torchvision.models.resnet18(weights=None).train()
    dal_model = dal.prepare_qat(torchvision.models.resnet18(weights=None), recipe="int8_balanced",
                                hardware="a2000", example_inputs=(x[:2],))
    dal.calibrate(dal_model, [x[:2]], progress=False)
    dal_model.train()
    if backend:
        return {"float": _step_fn(torch.compile(float_model, backend=backend), x, y),
                "dal int8 QAT": _step_fn(torch.compile(dal_model, backend=backend), x, y)}
    ao_model = torchvision.models.quantization.resnet18(weights=None, quantize=False)
    ao_model.fuse_model(is_qat=True)
    ao_model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        torch.ao.quantization.prepare_qat(ao_model.train(), inplace=True)
    return {"float": _step_fn(float_model, x, y), "dal int8 QAT": _step_fn(dal_model, x, y),
            "torch.ao QAT": _step_fn(ao_model, x, y)}


def _measure(size: int, batch: int, reps: int, backend: str | None = None) -> tuple[dict, dict]:
    """(wall, cpu): median seconds per step of each model, interleaved, after one warm-up step."""
    steps = _models(size, batch, backend)
    for fn in steps.values():
        fn()
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()})


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run(sizes, batch: int, reps: int, backend: str | None = None) -> list[str]:
    """Markdown lines: one table row per (resolution, clock)."""
    from dal.formats import native

    lines = [f"CPU: {_cpu_flags()}; {torch.get_num_threads()} torch threads; {os.cpu_count()} cores; "
             f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}", "",
             f"ResNet-18 train step (SGD), batch {batch}, medians of {reps} interleaved repetitions"
             + (f", torch.compile(backend={backend!r}) of both models" if backend else "") + ":", "",
             "| resolution | clock | float (ms) | dal INT8 QAT (ms) | dal / float | target | torch.ao (ms) "
             "| torch.ao / float | load average before -> after |", "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        before = _load()
        wall, cpu = _measure(size, batch, reps, backend)
        after = _load()
        for clock, med in (("wall", wall), ("CPU", cpu)):
            ratio, target = med["dal int8 QAT"] / med["float"], None if backend else TARGETS.get(size)
            verdict = "-" if target is None else f"{'ok' if ratio <= target else 'MISSED'} (<= {target})"
            ao = med.get("torch.ao QAT")
            ao_cols = "- | -" if ao is None else f"{1e3 * ao:.0f} | {ao / med['float']:.3f}"
            lines.append(f"| {size}x{size} | {clock} | {1e3 * med['float']:.0f} | {1e3 * med['dal int8 QAT']:.0f} | "
                         f"{ratio:.3f} | {verdict} | {ao_cols} | {before} -> {after} |")
    lines += ["", f"fused fake-quant kernel: {native.status()}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--res", "--size", dest="res", type=int, nargs="+", default=[112, 224],
                    help="input resolutions, measured in this one run (the overhead is mostly per call)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--write", metavar="PATH", help="also write the markdown table to PATH")
    ap.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="torch.compile both models with BACKEND (default inductor); no torch.ao column")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text = "\n".join(run(args.res, args.batch, args.reps, args.compile))
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
