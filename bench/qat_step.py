"""One ResNet-18 training step (batch 8, 112x112 and 224x224): float vs dal INT8 QAT vs torch.ao eager QAT.

Prints medians of interleaved repetitions and the two ratios against the float step.
Peer: torch.ao.quantization.prepare_qat with the x86 QAT qconfig on torchvision's quantizable
ResNet-18 (fused Conv+BN+ReLU), the reference QAT flow of PyTorch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

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


def _models(size: int, batch: int):
    import dal

    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))
    float_model = torchvision.models.resnet18(weights=None).train()
    dal_model = dal.prepare_qat(torchvision.models.resnet18(weights=None), recipe="int8_balanced",
                                hardware="a2000", example_inputs=(x[:2],))
    dal.calibrate(dal_model, [x[:2]], progress=False)
    dal_model.train()
    ao_model = torchvision.models.quantization.resnet18(weights=None, quantize=False)
    ao_model.fuse_model(is_qat=True)
    ao_model.qconfig = torch.ao.quantization.get_default_qat_qconfig("x86")
    torch.ao.quantization.prepare_qat(ao_model.train(), inplace=True)
    return {"float": _step_fn(float_model, x, y), "dal int8 QAT": _step_fn(dal_model, x, y),
            "torch.ao QAT": _step_fn(ao_model, x, y)}


def _measure(size: int, batch: int, reps: int) -> dict:
    steps = _models(size, batch)
    for fn in steps.values():  # warm up
        fn()
    times = {k: [] for k in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--res", "--size", dest="res", type=int, nargs="+", default=[112, 224],
                    help="input resolutions, measured in this one run (the overhead is mostly per call)")
    args = ap.parse_args()
    from dal.formats import native

    # Fresh large tensors cost page faults: say which allocator setting the numbers were taken with.
    print(f"CPU flags: {_cpu_flags()}; {torch.get_num_threads()} threads; fused fake-quant kernel: "
          f"{native.status()}; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    for size in args.res:
        med = _measure(size, args.batch, args.reps)
        print(f"ResNet-18 train step, batch {args.batch}, {size}x{size}, median of {args.reps} interleaved reps")
        for name, t in med.items():
            print(f"  {name:<14} {t * 1000:8.1f} ms   {t / med['float']:.2f}x float")
        target = TARGETS.get(size)
        print(f"dal / float = {med['dal int8 QAT'] / med['float']:.2f}"
              + (f" (target <= {target})" if target else "")
              + f"; torch.ao / float = {med['torch.ao QAT'] / med['float']:.2f}; "
              f"dal / torch.ao = {med['dal int8 QAT'] / med['torch.ao QAT']:.2f}")


if __name__ == "__main__":
    main()
