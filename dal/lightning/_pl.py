"""The Lightning package in use: ``pytorch_lightning`` or the unified ``lightning.pytorch``.

A callback must subclass the Callback of the package the user's Trainer comes from; the
standalone ``pytorch_lightning`` is tried first, then ``lightning.pytorch``.
"""
from __future__ import annotations

try:  # pragma: no cover - whichever is installed
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    try:
        import lightning.pytorch as pl
    except ImportError as err:
        raise ImportError("dal.lightning needs PyTorch Lightning: pip install 'dal[lightning]' "
                          "(pytorch-lightning>=2.0) or pip install lightning") from err

Callback = pl.Callback
LightningModule = pl.LightningModule

__all__ = ["pl", "Callback", "LightningModule"]
