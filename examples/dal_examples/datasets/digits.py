"""scikit-learn's 8x8 digits (1797 images, ships inside the scikit-learn wheel), upsampled to 28x28
so the same models serve MNIST and digits."""
from __future__ import annotations


def digits_loaders(batch_size: int = 64, train_fraction: float = 0.75, seed: int = 0):
    """(train_loader, test_loader): images 1x28x28 float, normalized to mean 0 / std 1 over the
    training split; a fixed, seeded split."""
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.tensor(data.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    n_train = int(train_fraction * len(y))
    tr, te = order[:n_train], order[n_train:]
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return (DataLoader(TensorDataset(x[tr], y[tr]), batch_size=batch_size, shuffle=True, generator=g),
            DataLoader(TensorDataset(x[te], y[te]), batch_size=512))
