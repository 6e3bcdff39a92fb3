"""A small LightningModule over MNIST for the callback tests (imported by tests/lightning)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import pytorch_lightning as pl
from dal_examples.zoo import MnistCNN


_PRETRAINED: dict = {}


def pretrained_state(width: int = 8) -> dict:
    """A float MnistCNN trained one epoch on 2048 images (~94%): QAT fine-tunes a trained model."""
    if width not in _PRETRAINED:
        from dal_examples.training import train_epoch

        torch.manual_seed(0)
        model = MnistCNN(width=width)
        loader, _ = mnist_subset(n_train=2048)
        train_epoch(model, loader, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        _PRETRAINED[width] = {k: v.clone() for k, v in model.state_dict().items()}
    return _PRETRAINED[width]


class LitMnist(pl.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.01, pretrained: bool = True):
        super().__init__()
        self.save_hyperparameters()
        self.model = MnistCNN(width=width)
        if pretrained:
            self.model.load_state_dict(pretrained_state(width))

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), on_step=False, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def mnist_subset(n_train: int = 512, n_test: int = 256, batch_size: int = 64):
    """Deterministic loaders (no shuffle: a resumed run sees the same batches as the original)."""
    from torch.utils.data import DataLoader, TensorDataset

    from dal_examples.datasets import load_mnist

    d = load_mnist()
    (xtr, ytr), (xte, yte) = d["train"], d["test"]
    norm = lambda x: (x - 0.1307) / 0.3081  # noqa: E731
    train = DataLoader(TensorDataset(norm(xtr[:n_train]), ytr[:n_train]), batch_size=batch_size)
    test = DataLoader(TensorDataset(norm(xte[:n_test]), yte[:n_test]), batch_size=batch_size)
    return train, test


def trainer(tmp_path, name: str, max_epochs: int = 2, callbacks=(), **kwargs) -> pl.Trainer:
    from pytorch_lightning.loggers import CSVLogger

    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, enable_progress_bar=False,
                      enable_model_summary=False, logger=CSVLogger(str(tmp_path), name=name),
                      enable_checkpointing=True, callbacks=list(callbacks), deterministic=True,
                      num_sanity_val_steps=0, **kwargs)
