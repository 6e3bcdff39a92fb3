"""One training step: float vs dal INT8 QAT vs torch.ao eager QAT, eager and compiled, one run.

Cases (issue 40): ResNet-18 batch 8 at 112x112 and 224x224, MobileNetV3-Large batch 8 at 224x224.
For each case, every step kind is timed round-robin (float, dal, torch.ao, compiled float,
compiled dal, float, ...) and the table gives medians and ratios against the float step of the
same mode, in wall-clock time and in CPU time of this process (``time.process_time``: on a
machine shared with other jobs the wall clock also counts the time this process waited for a
core; CPU time does not), with the load average before and after.
Peer: torch.ao.quantization.prepare_qat with the x86 QAT qconfig on torchvision's quantizable
model of the same architecture (fused Conv+BN+ReLU), the reference eager QAT flow of PyTorch.

    python bench/qat_step.py [--cases r18-112 r18-224 mnv3l-224] [--compile [BACKEND]] [--threads 1]
                             [--reps 7] [--write bench/results/qat_step_table.md]

``--compile BACKEND`` (default inductor) adds the compiled float and compiled dal columns
(``torch.compile`` of each model; the quantizers run dal.kernels' ops); their warm-up step
includes the compile. ``--no-layout-optimization`` passes inductor ``options={"layout_optimization":
False}`` to both (no channels-last relayout of the convolutions' activations).
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


def step_fn(model, x, y):
    """One SGD step (lr 1e-3, momentum 0.9) of ``model`` on ``(x, y)`` with cross-entropy; returns the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


#: case -> (torchvision architecture, resolution)
CASES = {"r18-112": ("resnet18", 112), "r18-224": ("resnet18", 224), "mnv3l-224": ("mobilenet_v3_large", 224)}
#: issue 40's targets: eager dal / float per resolution, compiled dal / compiled float, dal / torch.ao
EAGER_TARGETS = {112: 1.25, 224: 1.15}
COMPILED_TARGET = 1.10
PEER_TARGET = 0.8
#: inductor's layout optimization (channels-last convolutions) for the compiled steps; --no-layout-optimization
LAYOUT_OPTIMIZATION = True


def dal_model(arch: str, x: torch.Tensor):
    """torchvision ``arch`` (random weights) through ``dal.prepare_qat`` (int8_balanced, a2000),
    calibrated on ``x[:2]``, in training mode: the model of the "dal" steps."""
    import dal

    m = dal.prepare_qat(getattr(torchvision.models, arch)(weights=None), recipe="int8_balanced",
                        hardware="a2000", example_inputs=(x[:2],))
    dal.calibrate(m, [x[:2]], progress=False)
    return m.train()


def _models(arch: str, size: int, batch: int, backend: str | None = None) -> dict:
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))

    def qat():
        return dal_model(arch, x)

    ao_model = getattr(torchvision.models.quantization, arch)(weights=None, quantize=False)
    ao_model.fuse_model(is_qat=True)
    ao_model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices
        torch.ao.quantization.prepare_qat(ao_model.train(), inplace=True)
    steps = {"float": step_fn(getattr(torchvision.models, arch)(weights=None).train(), x, y),
             "dal": step_fn(qat(), x, y), "torch.ao": step_fn(ao_model, x, y)}
    if backend:
        opts = {"options": {"layout_optimization": False}} if not LAYOUT_OPTIMIZATION else {}
        steps["compiled float"] = step_fn(torch.compile(getattr(torchvision.models, arch)(weights=None).train(),
                                                         backend=backend, **opts), x, y)
        steps["compiled dal"] = step_fn(torch.compile(qat(), backend=backend, **opts), x, y)
    return steps


def _measure(arch: str, size: int, batch: int, reps: int, backend: str | None = None) -> tuple[dict, dict, dict]:
    """(wall, cpu, diverged): median seconds per step of each kind, round-robin, after one warm-up
    step each; diverged: kind -> the first timed repetition whose loss was not finite (from then on
    that kind times a diverged model: with NaN everywhere dal's quantizers take their torch paths,
    MobileNetV3 at 224 after about a dozen steps at this learning rate,
    when its dropout masks lead it there)."""
    steps = _models(arch, size, batch, backend)
    for fn in steps.values():
        fn()
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    diverged = {}
    for rep in range(reps):
        for name, fn in steps.items():
            t, c = time.perf_counter(), time.process_time()
            loss = fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            if name not in diverged and not bool(torch.isfinite(loss)):
                diverged[name] = rep
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()},
            diverged)


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _verdict(ratio: float, target: float | None) -> str:
    return f"{ratio:.3f}" if target is None else f"{ratio:.3f} {'ok' if ratio <= target else 'MISSED'} (<= {target})"


def run(cases, batch: int, reps: int, backend: str | None = None) -> list[str]:
    """Markdown lines: one table row per (case, clock)."""
    from dal.formats import native

    compiled = " | compiled float (ms) | compiled dal (ms) | compiled dal / compiled float | compiled dal / eager dal"
    lines = [f"CPU: {_cpu_flags()}; {torch.get_num_threads()} torch threads; {os.cpu_count()} cores", "",
             f"Train step (SGD), batch {batch}, medians of {reps} round-robin repetitions"
             + (f"; torch.compile(backend={backend!r}{'' if LAYOUT_OPTIMIZATION else ', options={layout_optimization: False}'})"
                if backend else "") + ":", "",
             "| case | clock | float (ms) | dal (ms) | dal / float | torch.ao (ms) | dal / torch.ao"
             + (compiled if backend else "") + " | load before -> after |",
             "|---" * (8 + (4 if backend else 0)) + "|"]
    warnings_ = []
    for case in cases:
        arch, size = CASES[case]
        before = _load()
        wall, cpu, diverged = _measure(arch, size, batch, backend=backend, reps=reps)
        after = _load()
        warnings_ += [f"{arch} {size}: the {k} step's loss is not finite from repetition {r} on (its median times a "
                      "diverged model; use fewer --reps)" for k, r in diverged.items()]
        for clock, med in (("wall", wall), ("CPU", cpu)):
            row = (f"| {arch} {size} | {clock} | {1e3 * med['float']:.0f} | {1e3 * med['dal']:.0f} | "
                   f"{_verdict(med['dal'] / med['float'], EAGER_TARGETS.get(size))} | {1e3 * med['torch.ao']:.0f} | "
                   f"{_verdict(med['dal'] / med['torch.ao'], PEER_TARGET)}")
            if backend:
                row += (f" | {1e3 * med['compiled float']:.0f} | {1e3 * med['compiled dal']:.0f} | "
                        f"{_verdict(med['compiled dal'] / med['compiled float'], COMPILED_TARGET)} | "
                        f"{_verdict(med['compiled dal'] / med['dal'], 1.0)}")
            lines.append(row + f" | {before} -> {after} |")
    lines += ["", f"fused fake-quant kernel: {native.status()}"] + [f"WARNING: {w}" for w in warnings_]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES),
                    help="architecture and resolution, all measured in this one run")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--write", metavar="PATH", help="also write the markdown table to PATH")
    ap.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="also time the compiled float and dal steps (torch.compile with BACKEND, default inductor)")
    ap.add_argument("--no-layout-optimization", action="store_true",
                    help='compile with inductor options={"layout_optimization": False}')
    args = ap.parse_args()
    global LAYOUT_OPTIMIZATION
    LAYOUT_OPTIMIZATION = not args.no_layout_optimization
    if args.threads:
        torch.set_num_threads(args.threads)
    text = "\n".join(run(args.cases, args.batch, args.reps, args.compile))
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
