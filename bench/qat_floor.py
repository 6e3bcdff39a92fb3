"""The least an observing quantizer can cost in a ResNet-18 training step, eager and compiled.

A float ResNet-18 whose every conv / fc input and weight, and both inputs of every residual add
(the tensors dal's int8_balanced quantizes), pass a stand-in quantizer written in plain torch,
timed round-robin with the float model and dal's QAT model, eager and under ``torch.compile``:

* ``--floor scale`` (default): ``x * (127 / max|x|)``, a batch reduction and one element-wise
  pass: what an observing quantizer must do at least (its scale depends on the batch's range),
  with no rounding, clamp or mask, so inductor may fuse the pass into its neighbours;
* ``--floor fq``: a whole fake quantization in plain torch (range, scale, round half to even,
  clamp, straight-through mask), as a user would write it for inductor.

Ratios are against the float step of the same mode; CPU time of this process (``time.process_time``),
medians of ``--reps`` rounds after two warm-up steps (the compiles).

    python bench/qat_floor.py [--size 112] [--reps 7] [--floor scale|fq]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock

from cpu import cpu_flags  # bench/cpu.py
from qat_step import dal_model, step_fn  # bench/qat_step.py


def scale_floor(x: torch.Tensor) -> torch.Tensor:
    """``x * (127 / max|x|)``: a batch range, then one element-wise pass."""
    return x * (127.0 / x.detach().abs().amax().clamp_min(1e-8))


def plain_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 fake quantization at the batch's range, straight-through inside it."""
    xd = x.detach()
    lo, hi = torch.aminmax(xd)
    s = (torch.maximum(hi, -lo) / 127.0).clamp_min(1e-8)
    q = torch.clamp(torch.round(xd / s), -128, 127) * s
    inside = (xd >= -128 * s) & (xd <= 127 * s)
    return torch.where(inside, x, xd) + (q - xd)


class _Conv(nn.Conv2d):
    """A Conv2d whose input and weight pass ``self.quant`` (an instance attribute)."""

    def forward(self, x):
        return self._conv_forward(self.quant(x), self.quant(self.weight), self.bias)


class _Linear(nn.Linear):
    """A Linear whose input and weight pass ``self.quant`` (an instance attribute)."""

    def forward(self, x):
        return F.linear(self.quant(x), self.quant(self.weight), self.bias)


def floor_model(quant) -> nn.Module:
    """torchvision's ResNet-18 (random weights) with ``quant`` where dal puts its quantizers."""
    model = torchvision.models.resnet18(weights=None)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Conv2d, nn.Linear):
                child.__class__ = _Conv if type(child) is nn.Conv2d else _Linear
                child.quant = quant
        if isinstance(parent, BasicBlock):
            parent.forward = _block_forward(parent, quant)
    return model.train()


def _block_forward(block: BasicBlock, quant):
    def forward(x):
        out = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(x)))))
        identity = block.downsample(x) if block.downsample is not None else x
        return block.relu(quant(out) + quant(identity))
    return forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--floor", choices=("scale", "fq"), default="scale")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(8, 3, args.size, args.size)
    y = torch.randint(0, 1000, (8,))
    quant = scale_floor if args.floor == "scale" else plain_fake_quant

    models = {"eager float": torchvision.models.resnet18(weights=None).train(),
              f"eager floor ({args.floor})": floor_model(quant),
              "eager dal": dal_model("resnet18", x),
              "compiled float": torch.compile(torchvision.models.resnet18(weights=None).train()),
              f"compiled floor ({args.floor})": torch.compile(floor_model(quant)),
              "compiled dal": torch.compile(dal_model("resnet18", x))}
    steps = {k: step_fn(m, x, y) for k, m in models.items()}
    for step in steps.values():
        step()
        step()
    load = os.getloadavg()
    times = {k: [] for k in steps}
    for _ in range(args.reps):
        for k, step in steps.items():
            t0 = time.process_time()
            step()
            times[k].append(time.process_time() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"CPU: {cpu_flags()}; 1 torch thread; ResNet-18 batch 8 at {args.size}, SGD; medians of {args.reps}; "
          f"load {load[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| step | CPU ms | / float of the same mode |\n|---|---|---|")
    for k, v in med.items():
        base = med["compiled float" if k.startswith("compiled") else "eager float"]
        print(f"| {k} | {v:.1f} | {v / base:.3f} |")


if __name__ == "__main__":
    main()
