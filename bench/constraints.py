"""Accuracy under the chip's constraints: power-of-two scales (shift-only requantizer) on MNIST and cluttered MNIST.

Rows: float, the fair float baseline (float trained for the QAT rows' extra steps), and on the
same float model PTQ / QAT with float scales (the peer, hardware generic_int8, recipe
int8_balanced) next to PTQ / QAT with power-of-two scales (hardware pow2_int8: every scale
2^k, shift requantizer, concat without requantization), for both roundings of log2 s (cover:
ceil, nearest: round) and for LSQ on log2 s. Every row is exported and run by dal.npu (the
"NPU ref" column); on pow2_int8 that is the shift requantizer the metadata declares.

    python bench/constraints.py                    # both data sets; writes bench/results/constraints.md
    python bench/constraints.py --data cluttered   # one data set; the other's section is kept
    python bench/constraints.py --quick            # smoke run

Data sets: MNIST (dal_examples.datasets.mnist_loaders) and the low-bit issue's harder task, cluttered
MNIST (dal_examples.datasets.cluttered_mnist_loaders: distorted digits with clutter, test split).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import tempfile
import time

import numpy as np
import torch

import dal
from dal.prepare import set_quantizer_state
from dal_examples.training import accuracy, train_epoch
from dal_examples.zoo import MnistCNN
from cpu import cpu_flags  # bench/cpu.py


def pow2_recipe(rounding: str, learnable: bool) -> dict:
    """The bundled pow2_int8 recipe with another rounding of log2 s / LSQ on log2 s."""
    w = {"format": "int8", "granularity": "per_channel", "symmetric": True, "observer": "minmax",
         "observer_args": {"power_of_two": rounding}, "learnable": learnable}
    a = {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "moving_average",
         "observer_args": {"averaging_constant": 0.01, "power_of_two": rounding}, "learnable": learnable}
    return {"name": f"pow2_{rounding}{'_lsq' if learnable else ''}",
            "rules": [{"type": ["conv", "conv_transpose", "linear"], "weight": w, "input": a},
                      {"type": ["matmul", "add", "mul", "cat", "pool", "activation", "resize"], "input": a}]}


def _chunks(total, per_epoch):
    while total > 0:
        yield min(total, per_epoch)
        total -= per_epoch


def _train(model, train, steps, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for n in _chunks(steps, len(train)):
        train_epoch(model, train, opt, max_batches=n)
    return model


def _npu_accuracy(model, test, example) -> float:
    import dal.npu
    set_quantizer_state(model, "frozen")
    model.eval()
    path = os.path.join(tempfile.mkdtemp(prefix="dal-constraints-"), "m.onnx")
    dal.export_onnx(model, (example,), path, dynamic_batch=True)
    sess = dal.npu.load(path, threads=1)
    correct = count = 0
    for x, y in test:
        correct += int((np.asarray(sess.run({"input": x.numpy()})[0]).argmax(1) == y.numpy()).sum())
        count += len(y)
    return 100.0 * correct / count


def run(train, test, epochs, steps, lr, rows) -> None:
    example = next(iter(test))[0][:4]
    torch.manual_seed(0)
    fm = _train(MnistCNN(), train, epochs * len(train), lr)
    rows.append(("float", accuracy(fm, test), None, ""))
    fair = _train(copy.deepcopy(fm), train, steps, lr / 5)
    rows.append(("float + the QAT rows' extra steps", accuracy(fair, test), None, "fair baseline"))
    cases = [("PTQ INT8, float scales (peer)", "int8_balanced", "generic_int8", 0),
             ("PTQ INT8, power-of-two scales (cover)", "pow2_int8", "pow2_int8", 0),
             ("PTQ INT8, power-of-two scales (nearest)", pow2_recipe("nearest", False), "pow2_int8", 0),
             ("QAT INT8, float scales (peer)", "int8_balanced", "generic_int8", steps),
             ("QAT INT8, power-of-two scales (cover)", "pow2_int8", "pow2_int8", steps),
             ("QAT INT8, power-of-two scales (nearest)", pow2_recipe("nearest", False), "pow2_int8", steps),
             ("QAT INT8, power-of-two LSQ on log2 s (nearest)", pow2_recipe("nearest", True), "pow2_int8", steps)]
    for label, recipe, hw, n in cases:
        t0 = time.time()
        m = dal.prepare_qat(copy.deepcopy(fm), recipe=recipe, hardware=hw, example_inputs=(example,))
        dal.calibrate(m, train, num_batches=16, progress=False)
        if n:
            _train(m, train, n, lr / 5)
        acc = accuracy(m, test)
        npu = _npu_accuracy(m, test, example)
        rows.append((label, acc, npu, f"{hw}, {time.time() - t0:.0f}s"))
        print(f"{label}: {acc:.2f}% (NPU {npu:.2f}%)", file=sys.stderr)


DATA = {  # name -> (title, train images, float epochs, QAT steps)
    "mnist": ("MNIST", 30000, 2, 234),
    "cluttered": ("cluttered MNIST", 50000, 4, 400),
}


def _loaders(name: str, quick: bool):
    from dal_examples.datasets import cluttered_mnist_loaders, mnist_loaders
    torch.manual_seed(0)
    loaders = cluttered_mnist_loaders if name == "cluttered" else mnist_loaders
    return loaders(batch_size=128, train_limit=3000 if quick else DATA[name][1], test_limit=1000 if quick else None)


def section(name: str, quick: bool) -> str:
    """Run one data set's rows; return its markdown section (a ``## title`` heading and a table)."""
    title = DATA[name][0]
    train, test = _loaders(name, quick)
    rows: list = []
    epochs, steps = (1, 20) if quick else DATA[name][2:]
    t0 = time.time()
    run(train, test, epochs, steps, 0.05, rows)
    lines = [f"## {title}", "", f"dal_examples.zoo.MnistCNN, {epochs} float epochs (SGD lr 0.05) on {len(train.dataset)} "
             f"images, {steps} QAT steps at lr 0.01, {len(test.dataset)} test images; "
             f"{time.time() - t0:.0f}s in all.", "",
             "| model | torch accuracy | NPU reference accuracy | note |", "|---|---|---|---|"]
    for label, acc, npu, note in rows:
        lines.append(f"| {label} | {acc:.2f}% | {'-' if npu is None else f'{npu:.2f}%'} | {note} |")
    fair = rows[1][1]
    best = max(a for label, a, _, _ in rows if label.startswith("QAT INT8, power-of-two"))
    lines += ["", f"Best power-of-two QAT row vs the fair float baseline: {best - fair:+.2f} points "
              f"(the claim: within 1.0 point)."]
    return "\n".join(lines)


def _old_sections(path: str) -> dict:
    """``title -> section text`` of an existing results file (a file without headings is MNIST's)."""
    if not os.path.exists(path):
        return {}
    body = open(path).read()
    if body.startswith("CPU flags"):
        # the first line is the CPU flags, followed (in files before the data-set sections) by MNIST's setup
        first, body = body.split("\n", 1)
        body = first.split(" thread. ", 1)[1] + "\n" + body if " thread. " in first else body
    parts = re.split(r"^(?=## )", body.strip(), flags=re.M)
    out = {}
    for part in parts:
        if part.startswith("## "):
            out[part.split("\n", 1)[0][3:].strip()] = part.strip()
        elif part.strip():
            out["MNIST"] = "## MNIST\n\n" + part.strip()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", choices=sorted(DATA), action="append",
                    help="data set(s) to run (default: both); a results file keeps the other's section")
    ap.add_argument("--write", default=None, help="results file (default bench/results/constraints.md; "
                                                   "--quick writes nothing unless given)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = args.write or (None if args.quick else os.path.join(os.path.dirname(__file__), "results", "constraints.md"))
    sections = _old_sections(out) if out else {}
    for name in args.data or ("mnist", "cluttered"):
        sections[DATA[name][0]] = section(name, args.quick)
        print(sections[DATA[name][0]], file=sys.stderr)
    order = [DATA[n][0] for n in ("mnist", "cluttered")]
    text = "\n\n".join([f"CPU flags: {cpu_flags()}; torch {torch.__version__}, 1 thread."]
                        + [sections[t] for t in order if t in sections])
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
