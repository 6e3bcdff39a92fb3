"""Run a model in eval mode for a moment and give every module its own training flag back.

``model.train(was_training)`` is not a restore: it sets *every* submodule to one flag, so a
BatchNorm or Dropout the user had put in eval mode inside a training model would silently train
again after a calibration, a verification or an export. :func:`eval_mode` records each module's
flag by its path and restores exactly those.
"""
from __future__ import annotations

import contextlib

from torch import nn


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """``model.eval()`` inside the block; afterwards each module gets the flag it had before.

    Modules swapped in during the block (prepare reverting a layer to float, say) are found by
    path: one at a recorded path takes that path's flag, one at a new path its nearest recorded
    ancestor's, so the tree ends up as it was before, module for module.
    """
    before = {path: m.training for path, m in model.named_modules()}
    model.eval()
    try:
        yield model
    finally:
        for path, m in model.named_modules():
            key = path
            while key not in before and key:
                key = key.rpartition(".")[0]
            m.training = before.get(key, before.get("", False))
