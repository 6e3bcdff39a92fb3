"""PTQ accuracy of every calibration method, and QAT, at W4A8 on MNIST (MnistCNN and a 1-channel ResNet-18).

    python bench/calibration.py [--quick]

Float models are trained briefly here (no pretrained weights ship in any wheel). W4A8: int4
per-channel symmetric weights, int8 per-tensor affine activations (min-max observers), on the
a2000 hardware model. Each method calibrates on the same batches; QAT starts from min-max and
trains a few hundred steps. Prints a markdown table and says plainly whether kl / mse /
easyquant beat min-max on each model.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

W4A8 = {"name": "w4a8_bench", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
    {"type": ["add", "pool"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}
METHODS = ["minmax", "percentile", "kl", "mse", "easyquant"]


def resnet18_mnist() -> nn.Module:
    import torchvision

    m = torchvision.models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
    return m


def main(argv=None) -> int:
    import dal
    from dal_examples.datasets import mnist_loaders
    from dal_examples.training import accuracy, train_epoch
    from dal_examples.zoo import MnistCNN

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer images and steps (a smoke run)")
    args = ap.parse_args(argv)
    n_train, n_test, qat_steps = (5000, 1000, 30) if args.quick else (20000, 10000, 200)
    train, test = mnist_loaders(batch_size=64, train_limit=n_train, test_limit=n_test)
    calib = [b for _, b in zip(range(8), train)]
    x = calib[0][0][:8]
    table, verdicts = [], []
    for name, factory in (("MnistCNN", MnistCNN), ("ResNet-18 (1 channel)", resnet18_mnist)):
        torch.manual_seed(0)
        net = factory()
        t0 = time.time()
        train_epoch(net, train, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
        row = {"model": name, "float": accuracy(net, test)}
        print(f"{name}: float {row['float']:.2f}% ({time.time() - t0:.0f} s)", flush=True)
        for method in METHODS:
            t0 = time.time()
            q = dal.prepare_qat(copy.deepcopy(net), recipe=W4A8, hardware="a2000", example_inputs=(x,))
            dal.calibrate(q, calib, method=method, progress=False)
            row[method] = accuracy(q, test)
            row[f"{method}_s"] = time.time() - t0
            print(f"  PTQ {method}: {row[method]:.2f}% ({row[f'{method}_s']:.1f} s)", flush=True)
            if method == "minmax":
                opt = torch.optim.SGD(q.parameters(), lr=0.01, momentum=0.9)
                train_epoch(q, train, opt, max_batches=qat_steps)
                row["qat"] = accuracy(q, test)
        table.append(row)
        better = [m for m in ("kl", "mse", "easyquant") if row[m] > row["minmax"]]
        verdicts.append(f"{name}: " + (f"{', '.join(better)} beat min-max" if better else
                                       "kl / mse / easyquant do NOT beat min-max"))
    print("\n| model | float | " + " | ".join(f"PTQ {m}" for m in METHODS) + f" | QAT ({qat_steps} steps from min-max) |")
    print("|---|---|" + "---|" * len(METHODS) + "---|")
    for r in table:
        print(f"| {r['model']} | {r['float']:.2f} | " + " | ".join(f"{r[m]:.2f}" for m in METHODS) + f" | {r['qat']:.2f} |")
    print("\nW4A8 (int4 per-channel weights, int8 per-tensor activations), MNIST test accuracy in %, "
          f"{n_test} test images; calibration on 8 batches of 64.")
    for v in verdicts:
        print(v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
