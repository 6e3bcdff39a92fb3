"""PyTorch Lightning integration; imported explicitly (``import dal.lightning``), never by ``import dal``.

* :class:`QATCallback` — prepare, calibrate, freeze, checkpoint, export and verify inside ``Trainer.fit``;
* :func:`restore_qat_checkpoint` — rebuild a QAT LightningModule from a checkpoint without a Trainer.
"""
from .callback import QATCallback
from .checkpoint import restore_qat_checkpoint

__all__ = ["QATCallback", "restore_qat_checkpoint"]
