"""Plain torch DDP (two gloo processes): observers all-reduce, so every rank holds the same scales."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ddp_common import differing, free_port, is_bn_running_stat
from ddp_workers import plain_ddp_worker

pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]

ORDERS = ["calibrate-then-wrap", "wrap-then-calibrate"]


@pytest.fixture(scope="session")  # once per xdist worker, even when the group interleaves modules
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("ddp")
    mp.spawn(plain_ddp_worker, args=(2, free_port(), str(path)), nprocs=2, join=True)
    return path


def _load(out, order, name):
    return torch.load(out / order / name, weights_only=False)


@pytest.mark.parametrize("order", ORDERS)
def test_ranks_agree_after_calibration(out, order):
    # Calibration saw different shards, yet every buffer (scales, observer ranges) is the same.
    assert differing(_load(out, order, "calib_rank0.pt"), _load(out, order, "calib_rank1.pt")) == []


@pytest.mark.parametrize("order", ORDERS)
def test_ranks_agree_during_qat_and_frozen(out, order):
    calib0 = _load(out, order, "calib_rank0.pt")
    train0, train1 = _load(out, order, "train_rank0.pt"), _load(out, order, "train_rank1.pt")
    assert differing(train0, train1, skip=is_bn_running_stat) == []
    # The moving-average observers did move during QAT (identically on both ranks).
    moved = [k for k in train0 if k.endswith("input_quant.scale") and not torch.equal(train0[k], calib0[k])]
    assert moved, "activation scales should follow the data during QAT"
    frozen0, frozen1 = _load(out, order, "frozen_rank0.pt"), _load(out, order, "frozen_rank1.pt")
    assert differing(frozen0, frozen1, skip=is_bn_running_stat) == []
    assert all(torch.equal(frozen0[k], train0[k]) for k in train0 if k.endswith(".scale"))  # frozen: no drift


def test_learnable_scales_train_identically_on_every_rank(out):
    """LSQ under DDP (calibrate, then wrap: learnable scales get their shape at calibration, and
    DDP registers parameters when it wraps): scales are Parameters, DDP averages their gradients,
    so every rank holds the same trained scales, and they did train."""
    calib0 = _load(out, "lsq", "calib_rank0.pt")
    train0, train1 = _load(out, "lsq", "train_rank0.pt"), _load(out, "lsq", "train_rank1.pt")
    assert differing(calib0, _load(out, "lsq", "calib_rank1.pt")) == []
    assert differing(train0, train1, skip=is_bn_running_stat) == []
    learned = [k for k in train0 if k.endswith(("weight_quant.scale", "input_quant.scale")) and train0[k].numel()]
    assert learned and any(not torch.equal(train0[k], calib0[k]) for k in learned), "no learnable scale moved"
    frozen0, frozen1 = _load(out, "lsq", "frozen_rank0.pt"), _load(out, "lsq", "frozen_rank1.pt")
    assert differing(frozen0, frozen1, skip=is_bn_running_stat) == []
    # (this plain-SGD loop gives the scales the weights' learning rate, and a step pushes some
    # per-channel weight scales to <= 0: the next forward projects them back, tests/test_quantizer.py)


def test_rank0_checkpoint_loads_anywhere(out):
    """A state_dict saved on rank 0 rebuilds the same model in another process: prepare_qat, then load."""
    import dal
    from dal_examples.zoo import MnistCNN

    sd = _load(out, ORDERS[0], "frozen_rank0.pt")
    x = torch.randn(2, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(width=8), "int8_balanced", "a2000", example_inputs=(x,))
    model.load_state_dict(sd)
    assert differing(sd, model.state_dict()) == []
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
