#!/usr/bin/env python
"""dal.export_onnx on a prepared ResNet-18 vs torch.onnx.export (TorchScript) of the float model.

Both export the same architecture with the same weights, to memory, interleaved (the machine is
shared: absolute times swing 1.5-2x between runs), one warm-up each; medians and their ratio
are printed. Target: ratio <= 3. dal's time includes everything a user waits for: the trace, the
graph rewrite, quantizing 11.7M weights, onnx.checker (full) and building the ModelProto.
"""
from __future__ import annotations

import argparse
import copy
import io
import statistics
import time
import warnings

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--recipe", default="int8_balanced")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import torchvision

    import dal
    from dal.export import export_onnx

    torch.manual_seed(0)
    float_model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, args.size, args.size)
    qat = dal.prepare_qat(copy.deepcopy(float_model), recipe=args.recipe, example_inputs=(x,))
    dal.calibrate(qat, [torch.randn(1, 3, args.size, args.size)], progress=False)
    qat.eval()

    def peer():
        torch.onnx.export(float_model, (x,), io.BytesIO(), dynamo=False, opset_version=13,
                          do_constant_folding=True)

    def ours():
        export_onnx(qat, (x,))

    times = {"torch.onnx.export (float, TorchScript)": [], "dal.export_onnx (QDQ)": []}
    peer(), ours()  # warm-up
    for _ in range(args.repeats):
        for name, fn in zip(times, (peer, ours)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"ResNet-18 1x3x{args.size}x{args.size}, recipe {args.recipe}, {args.repeats} interleaved runs, "
          f"{torch.get_num_threads()} threads")
    for k, v in times.items():
        print(f"  {k:42s} median {med[k]:.3f} s  (runs: {', '.join(f'{t:.2f}' for t in v)})")
    a, b = med.values()
    print(f"  ratio dal / torch: {b / a:.2f}x (target <= 3x)")


if __name__ == "__main__":
    main()
