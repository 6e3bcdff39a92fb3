"""Accuracy under the chip's constraints: power-of-two scales (shift-only requantizer) on MNIST.

Rows: float, the fair float baseline (float trained for the QAT rows' extra steps), and on the
same float model PTQ / QAT with float scales (the peer, hardware generic_int8, recipe
int8_balanced) next to PTQ / QAT with power-of-two scales (hardware pow2_int8: every scale
2^k, shift requantizer, concat without requantization), for both roundings of log2 s (cover:
ceil, nearest: round) and for LSQ on log2 s. Every row is exported and run by dal.npu (the
"NPU ref" column); on pow2_int8 that is the shift requantizer the metadata declares.

    python bench/constraints.py            # writes bench/results/constraints.md
    python bench/constraints.py --quick    # smoke run
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

import dal
from dal.prepare import set_quantizer_state
from dal.training import accuracy, train_epoch
from dal.zoo import MnistCNN
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--write", default=None, help="results file (default bench/results/constraints.md; "
                                                   "--quick writes nothing unless given)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from dal.datasets import mnist_loaders
    torch.manual_seed(0)
    train, test = mnist_loaders(batch_size=128, train_limit=3000 if args.quick else 30000,
                                test_limit=1000 if args.quick else None)
    rows: list = []
    epochs, steps = (1, 20) if args.quick else (2, 234)
    run(train, test, epochs, steps, 0.05, rows)
    flags = cpu_flags()
    lines = [f"CPU flags: {flags}; torch {torch.__version__}, 1 thread. MNIST, dal.zoo.MnistCNN, "
             f"{epochs} float epochs on {len(train.dataset) if hasattr(train, 'dataset') else '?'} images, "
             f"{steps} QAT steps at lr 0.01.", "",
             "| model | torch accuracy | NPU reference accuracy | note |", "|---|---|---|---|"]
    for label, acc, npu, note in rows:
        lines.append(f"| {label} | {acc:.2f}% | {'-' if npu is None else f'{npu:.2f}%'} | {note} |")
    fair = rows[1][1]
    best = max(a for label, a, _, _ in rows if label.startswith("QAT INT8, power-of-two"))
    lines += ["", f"Best power-of-two QAT row vs the fair float baseline: {best - fair:+.2f} points "
              f"(the claim: within 1.0 point)."]
    text = "\n".join(lines)
    print(text)
    out = args.write or (None if args.quick else os.path.join(os.path.dirname(__file__), "results", "constraints.md"))
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
