#!/usr/bin/env python
"""dal.export_onnx on a prepared ResNet-18 vs torch.onnx.export (TorchScript) of the float model.

Both export the same architecture with the same weights, to memory, interleaved (the machine is
shared: absolute times swing 1.5-2x between runs), one warm-up each; medians and their ratio
are printed. Target: ratio <= 3. dal's time includes everything a user waits for: the trace, the
graph rewrite, quantizing 11.7M weights, onnx.checker (full) and building the ModelProto.

``--dynamo`` adds the dynamo route: ``dal.export_onnx(route="dynamo")`` against its own peer,
``torch.onnx.export(dynamo=True)`` of the float model (opset 18, the dynamo exporter's least),
interleaved with the two above.

    python bench/export.py --size 64 --repeats 3 --dynamo
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
    ap.add_argument("--dynamo", action="store_true", help="also time the dynamo route and its peer")
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

    def peer_dynamo():
        torch.onnx.export(float_model, (x,), dynamo=True, opset_version=18, verbose=False).model_proto

    def ours_dynamo():
        export_onnx(qat, (x,), route="dynamo")

    runs = {"torch.onnx.export (float, TorchScript)": peer, "dal.export_onnx (QDQ)": ours}
    if args.dynamo:
        runs.update({"torch.onnx.export (float, dynamo)": peer_dynamo, "dal.export_onnx (QDQ, route=dynamo)": ours_dynamo})
    times = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"ResNet-18 1x3x{args.size}x{args.size}, recipe {args.recipe}, {args.repeats} interleaved runs, "
          f"{torch.get_num_threads()} threads")
    for k, v in times.items():
        print(f"  {k:42s} median {med[k]:.3f} s  (runs: {', '.join(f'{t:.2f}' for t in v)})")
    names = list(med)
    print(f"  ratio dal / torch: {med[names[1]] / med[names[0]]:.2f}x (target <= 3x)")
    if args.dynamo:
        print(f"  dynamo route: dal / torch {med[names[3]] / med[names[2]]:.2f}x; "
              f"dal's dynamo / TorchScript route {med[names[3]] / med[names[1]]:.2f}x")


if __name__ == "__main__":
    main()
