"""Lightning ``strategy="ddp"`` on CPU, two processes, with QATCallback: each rank writes its
state_dict after calibration and at the end of training into ``argv[1]``.

Run as a script (Lightning's DDP launcher re-executes this file for rank 1), never imported by pytest.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def main(out: str) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from dal_examples.datasets import load_mnist
    from dal.lightning import QATCallback
    from dal_examples.zoo import MnistCNN

    torch.set_num_threads(1)

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = MnistCNN(width=8)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Recorder(pl.Callback):
        def _save(self, trainer, pl_module, tag):
            sd = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            torch.save(sd, f"{out}/{tag}_rank{trainer.global_rank}.pt")

        def on_train_start(self, trainer, pl_module):  # runs after QATCallback's (callback order)
            self._save(trainer, pl_module, "calib")

        def on_train_end(self, trainer, pl_module):
            self._save(trainer, pl_module, "final")

    x, y = load_mnist()["train"]
    x, y = (x[:768] - 0.1307) / 0.3081, y[:768]
    loader = DataLoader(TensorDataset(x, y), batch_size=64)  # Lightning adds a DistributedSampler
    qat = QATCallback("int8_balanced", "a2000", calibrate_batches=2, freeze_observers_at_epoch=1,
                      freeze_bn_at_epoch=1, example_inputs=torch.zeros(1, 1, 28, 28))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=f"{out}/ckpt", filename="last")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, enable_progress_bar=False,
                         enable_model_summary=False, logger=CSVLogger(out), callbacks=[qat, Recorder(), ckpt],
                         num_sanity_val_steps=0)
    trainer.fit(Lit(), loader)


if __name__ == "__main__":
    main(sys.argv[1])
