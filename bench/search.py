"""Latency estimates of the bundled recipes, and dal.search_precision measured on MNIST.

1. The estimated latency (dal.estimate, the hardware YAMLs' illustrative cost sections) of every
   bundled recipe on every bundled hardware, for ResNet-18 (1x3x224x224) and the house MNIST CNN
   (dal_examples.zoo.MnistCNN, a batch of 32).
2. On MNIST and on cluttered MNIST (the harder 10-class task of dal_examples.datasets.cluttered): uniform INT8 and uniform W4A8 against the searched recipe (Fisher scores) at 1.0x,
   0.8x and 0.6x of uniform INT8's latency and at W4A8's own latency; every row is QAT-trained
   the same number of steps, then exported and run on dal.npu (the "NPU" column). The Pareto
   front of the last search is shown at 8 points, each QAT-trained the same way ("measured").
3. Speed: search time for ResNet-18 with 4 candidates (x dense / 2:4), Fisher against output
   error, and the estimator's time per model; the peer is one plain forward of the same model.

    python bench/search.py [--quick]     # writes bench/results/search.md
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torchvision

import dal
from dal.cost import estimate, search_precision
from dal_examples.training import accuracy, train_epoch
from dal_examples.zoo import MnistCNN
from cpu import cpu_flags  # bench/cpu.py

RECIPES = dal.recipe.list_recipes()      # every bundled recipe and hardware model, as they stand
HARDWARE = dal.hardware.list_hardware()


def recipe_table() -> list[str]:
    lines = ["| model | recipe | " + " | ".join(HARDWARE) + " |", "|---|---|" + "---|" * len(HARDWARE)]
    for label, factory, x in [("ResNet-18 1x3x224x224", torchvision.models.resnet18, torch.randn(1, 3, 224, 224)),
                              ("MNIST CNN 32x1x28x28", MnistCNN, torch.randn(32, 1, 28, 28))]:
        torch.manual_seed(0)
        model = factory().eval()
        for recipe in RECIPES:
            cells = []
            for hw in HARDWARE:
                try:
                    q = dal.prepare_qat(copy.deepcopy(model), recipe=recipe, hardware=hw, example_inputs=(x,))
                    cells.append(f"{estimate(q, example_inputs=(x,)).total_ms:.3f} ms")
                except ValueError:  # the recipe asks for a format the hardware lacks (fp16 / int4)
                    cells.append("refused by prepare")
                except Exception as err:  # noqa: BLE001 - the table says what failed instead of stopping
                    cells.append(f"error ({type(err).__name__})")
            lines.append(f"| {label} | {recipe} | " + " | ".join(cells) + " |")
    return lines


def _npu_accuracy(model, test, example) -> float:
    import dal.npu

    path = os.path.join(tempfile.mkdtemp(prefix="dal-search-"), "m.onnx")
    dal.export_onnx(model, (example,), path, dynamic_batch=True)
    sess = dal.npu.load(path)
    correct = count = 0
    for x, y in test:
        correct += int((np.asarray(sess.run({"input": x.numpy()})[0]).argmax(1) == y.numpy()).sum())
        count += len(y)
    return 100.0 * correct / count


def _qat(fm, recipe, train, steps, example):
    q = dal.prepare_qat(copy.deepcopy(fm), recipe=recipe, hardware="a2000", example_inputs=(example,))
    dal.calibrate(q, train, num_batches=16, progress=False)
    train_epoch(q, train, torch.optim.SGD(q.parameters(), lr=0.01, momentum=0.9), max_batches=steps)
    dal.set_quantizer_state(q, "frozen")
    q.eval()
    return q


def mnist_rows(quick: bool, dataset: str = "mnist") -> list[str]:
    from dal_examples.datasets import cluttered_mnist_loaders, mnist_loaders

    torch.manual_seed(0)
    loaders = mnist_loaders if dataset == "mnist" else cluttered_mnist_loaders
    def fresh():  # every row trains on the same batches in the same order: differences are the recipe's
        return loaders(batch_size=32, train_limit=3000 if quick else 20000, test_limit=1000 if quick else 5000)

    train, test = fresh()
    fm = MnistCNN()
    opt = torch.optim.SGD(fm.parameters(), lr=0.05, momentum=0.9)
    for _ in range(1 if dataset == "mnist" or quick else 3):
        train_epoch(fm, train, opt)
    fm.eval()
    example = next(iter(train))[0]
    calib = [b for _, b in zip(range(8), train)]
    steps = 30 if quick else 300
    q8 = dal.prepare_qat(copy.deepcopy(fm), recipe="int8_balanced", hardware="a2000", example_inputs=(example,))
    q4 = dal.prepare_qat(copy.deepcopy(fm), recipe="w4a8_fp8_performance", hardware="a2000", example_inputs=(example,))
    int8_ms = estimate(q8, example_inputs=(example,)).total_ms
    w4_ratio = estimate(q4, example_inputs=(example,)).total_ms / int8_ms
    rows = [("uniform INT8 (int8_balanced)", "int8_balanced", None),
            ("uniform W4A8 (w4a8_fp8_performance)", "w4a8_fp8_performance", None)]
    for frac in (1.0, 0.8, 0.6, round(w4_ratio, 4)):
        t0 = time.perf_counter()
        res = search_precision(fm, calib, "a2000", latency_budget=f"{frac}x", example_inputs=(example,))
        rows.append((f"searched at {frac:g}x INT8 ({time.perf_counter() - t0:.1f} s): "
                     + ", ".join(f"{k}={v}" for k, v in res.choice.items()), res.recipe, res))
    lines = [f"float MnistCNN: {accuracy(fm, test):.2f}% (a2000, batch 32; every row: {steps} QAT steps)", "",
             "| recipe | est. latency (ms) | x INT8 | torch accuracy | NPU accuracy |", "|---|---|---|---|---|"]
    for label, recipe, res in rows:
        torch.manual_seed(0)
        q = _qat(fm, recipe, fresh()[0], steps, example)
        ms = estimate(q, example_inputs=(example,)).total_ms
        lines.append(f"| {label} | {ms:.4f} | {ms / int8_ms:.3f} | {accuracy(q, test):.2f}% | "
                     f"{_npu_accuracy(q, test, example[:4]):.2f}% |")
        print(lines[-1], file=sys.stderr)
    last = rows[-1][2]
    for i in last.spread(8):  # each shown point trained exactly as the rows above: its QAT torch accuracy
        torch.manual_seed(0)
        q = _qat(fm, last.recipe_for(last.front[i][3]), fresh()[0], steps, example)
        last.measured[i] = accuracy(q, test)
        print(f"front point {last.front[i][0]:.4f} ms: {last.measured[i]:.2f}%", file=sys.stderr)
    lines += ["", f"Pareto front of the last search ({last.method}; predicted score = summed Fisher estimate of "
              f"the loss increase; measured = torch accuracy (%) after the same {steps} QAT steps as the rows "
              "above):", "", last.pareto_table(8)]
    return lines


def speed_rows(quick: bool) -> list[str]:
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 112, 112)
    calib = [(torch.randn(2, 3, 112, 112), torch.randint(0, 1000, (2,))) for _ in range(2)]
    t0 = time.perf_counter()
    with torch.no_grad():
        model(x)
    fwd = time.perf_counter() - t0
    lines = ["| what | seconds | x one forward |", "|---|---|---|"]
    for method in ("fisher", "output_error"):
        t0 = time.perf_counter()
        res = search_precision(model, calib, "a2000", latency_budget="0.8x", method=method, num_batches=2,
                               example_inputs=(x,))
        dt = time.perf_counter() - t0
        lines.append(f"| search_precision ResNet-18 2x3x112x112, {method}, 2 batches, "
                     f"{sum(len(v) for v in res.scores.values())} (layer, candidate) pairs | {dt:.2f} | {dt / fwd:.0f} |")
    for label, factory, shape in [("ResNet-18", torchvision.models.resnet18, (1, 3, 224, 224)),
                                  ("MobileNetV2", torchvision.models.mobilenet_v2, (1, 3, 224, 224)),
                                  ("MNIST CNN", MnistCNN, (32, 1, 28, 28))]:
        m = factory().eval()
        xi = torch.randn(shape)
        q = dal.prepare_qat(m, recipe="int8_balanced", hardware="a2000", example_inputs=(xi,))
        t0 = time.perf_counter()
        with torch.no_grad():
            q(xi)
        f = time.perf_counter() - t0
        t0 = time.perf_counter()
        estimate(q, example_inputs=(xi,))
        dt = time.perf_counter() - t0
        lines.append(f"| dal.estimate {label} {'x'.join(map(str, shape))} | {dt:.3f} | {dt / f:.1f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write", default=os.path.join(os.path.dirname(__file__), "results", "search.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    head = [f"# bench/search.py{' --quick' if args.quick else ''}", "",
            f"CPU flags: {cpu_flags()}; torch {torch.__version__}, 1 thread. Latencies are dal.estimate figures "
            "from the ILLUSTRATIVE cost sections of hardware_models/*.yaml, not measurements.", ""]
    out = head + ["## Estimated latency of the bundled recipes", ""] + recipe_table()
    out += ["", "## Searched mixed precision on MNIST (a2000)", ""] + mnist_rows(args.quick)
    out += ["", "## Searched mixed precision on cluttered MNIST (dal_examples.datasets.cluttered, a2000)", ""]
    out += mnist_rows(args.quick, "cluttered")
    out += ["", "## Speed", ""] + speed_rows(args.quick)
    text = "\n".join(out) + "\n"
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
