"""Lightning DDP on CPU (two real gloo processes) with QATCallback: the ranks agree on every scale."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_common import differing

pytest.importorskip("pytorch_lightning")
pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("lightning_ddp_script.py")


@pytest.fixture(scope="session")  # once per xdist worker, even when the group interleaves modules
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("pl_ddp")
    res = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return path


def _load(out, name):
    return torch.load(out / name, weights_only=False)


def test_ranks_agree_after_calibration(out):
    a, b = _load(out, "calib_rank0.pt"), _load(out, "calib_rank1.pt")
    assert any(k.endswith("input_quant.scale") and v.numel() for k, v in a.items())
    assert differing(a, b) == []


def test_ranks_agree_after_training(out):
    a, b = _load(out, "final_rank0.pt"), _load(out, "final_rank1.pt")
    # BN statistics are frozen from epoch 1 (and rank 0's copy was broadcast at its first
    # forward), so after training even they agree: the whole state_dict is identical.
    assert differing(a, b) == []
    calib = _load(out, "calib_rank0.pt")
    assert any(k.endswith("input_quant.scale") and not torch.equal(a[k], calib[k]) for k in a)
    states = {int(v) for k, v in a.items() if k.endswith("state_code")}
    assert states == {2}  # every quantizer frozen from epoch 1


def test_rank0_checkpoint_restores_the_trained_model(out):
    from dal.lightning import restore_qat_checkpoint

    import pytorch_lightning as pl
    from dal_examples.zoo import MnistCNN

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = MnistCNN(width=8)

    module = restore_qat_checkpoint(Lit(), out / "ckpt" / "last.ckpt")
    assert differing(_load(out, "final_rank0.pt"), module.state_dict()) == []
