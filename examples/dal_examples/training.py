"""A plain training / evaluation loop for examples, demos and benchmarks (not used by the library)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def train_epoch(model, loader, optimizer, max_batches=None, loss_fn=None) -> float:
    """One epoch of cross-entropy training; returns the mean loss."""
    model.train()
    total, n = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        optimizer.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out, y, x) if loss_fn else F.cross_entropy(out, y)
        loss.backward()
        optimizer.step()
        total, n = total + float(loss.detach()), n + 1
    return total / max(n, 1)


@torch.no_grad()
def accuracy(model, loader, max_batches=None) -> float:
    """Top-1 accuracy in percent."""
    model.eval()
    correct = count = 0
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        correct += int((model(x).argmax(1) == y).sum())
        count += int(y.numel())
    return 100.0 * correct / max(count, 1)
