"""One eager LSQ QAT training step (recipe w4a8_lsq: every conv / linear scale learned, the
activations' zero points too: LSQ+) of torchvision ResNet-18, batch 8 at 112x112: FakeQuantizer's LSQ through
``dal::fake_quantize_lsq`` (its CPU kernels) against the same model with each learnable quantizer
on the route it replaced (``dal.formats.fake_quantize(learnable=True)``: FakeQuantizeFunction, plain
torch), and the float model, interleaved (float, new, replaced, float, ...), medians of CPU time
(``time.process_time``) and wall time. The share of the step the kernel buys is
``(replaced - new) / replaced``.

    python bench/lsq_step.py [--reps 9] [--threads N] [--size 112] [--batch 8]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import types
import warnings

import torch
import torch.nn.functional as F
import torchvision

from cpu import cpu_flags  # bench/cpu.py


def _replaced_forward(self, x):
    """FakeQuantizer's LSQ forward before dal::fake_quantize_lsq (the same projection and g)."""
    from dal.formats import fake_quantize
    from dal.kernels import lsq_grad_scale
    self.project_learned_qparams_()
    g = lsq_grad_scale(x.numel(), self.scale.numel(), self.qmax)
    return fake_quantize(x, self.fmt, self.scale, self.zero_point, self.granularity, self.narrow_range,
                         learnable=True, grad_scale=g, check=False)


def _step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    import dal
    from dal.quantizer import quantizers
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.randn(a.batch, 3, a.size, a.size)
    y = torch.randint(0, 1000, (a.batch,))
    float_model = torchvision.models.resnet18().train()
    model = dal.prepare_qat(copy.deepcopy(float_model), recipe="w4a8_lsq", hardware="a2000", example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dal.calibrate(model, [x], progress=False)
    model.train()
    replaced = copy.deepcopy(model)
    n = 0
    for _, q in quantizers(replaced):
        if q.learnable:
            q._learnable_forward = types.MethodType(_replaced_forward, q)
            n += 1
    steps = {"float": _step(float_model, x, y), "dal LSQ, dal::fake_quantize_lsq": _step(model, x, y),
             "dal LSQ, replaced route (FakeQuantizeFunction)": _step(replaced, x, y)}
    cpu = {k: [] for k in steps}
    wall = {k: [] for k in steps}
    load0 = os.getloadavg()
    for rep in range(a.reps + 1):  # the first round warms up and is dropped
        for name, step in steps.items():
            c0, w0 = time.process_time(), time.perf_counter()
            step()
            if rep:
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    print(f"ResNet-18 batch {a.batch} {a.size}x{a.size}, w4a8_lsq ({n} learnable quantizers), eager, "
          f"{torch.get_num_threads()} threads, {a.reps} interleaved reps; CPU: {cpu_flags()}")
    print(f"load average {load0} -> {os.getloadavg()}")
    base = statistics.median(cpu["float"])
    print(f"{'step':52s} {'CPU ms':>8s} {'wall ms':>8s} {'CPU x float':>12s}")
    for name in steps:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"{name:52s} {c * 1e3:8.1f} {w * 1e3:8.1f} {c / base:12.3f}")
    new, old = (statistics.median(cpu[k]) for k in list(steps)[1:])
    print(f"share of the replaced LSQ step bought: {(old - new) / old * 100:.1f}% (CPU time)")


if __name__ == "__main__":
    main()
