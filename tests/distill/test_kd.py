"""dal.distill: the KD loss's formula, feature distillation, a plain loop and the Lightning route."""
from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.distill import Distiller, FeatureLoss, KDLoss, kd_divergence


def test_kd_divergence_matches_the_formula():
    torch.manual_seed(0)
    s, t, T = torch.randn(5, 7), torch.randn(5, 7), 3.0
    p_t = torch.softmax(t / T, 1)
    want = (p_t * (p_t.log() - torch.log_softmax(s / T, 1))).sum(1).mean() * T * T
    assert torch.allclose(kd_divergence(s, t, T), want, atol=1e-6)
    assert float(kd_divergence(t, t, T)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="shape"):
        kd_divergence(s, t[:, :3])


def test_kd_loss_blends_task_and_distillation_and_teacher_gets_no_grad():
    torch.manual_seed(0)
    teacher, student = nn.Linear(4, 3), nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss_fn = KDLoss(teacher, T=4, alpha=0.25)
    out = student(x)
    loss = loss_fn(out, y, x)
    want = 0.75 * F.cross_entropy(out, y) + 0.25 * kd_divergence(out, teacher(x), 4)
    assert torch.allclose(loss, want, atol=1e-6)
    loss.backward()
    assert teacher.weight.grad is None and student.weight.grad is not None
    assert set(loss_fn.last) == {"task", "kd", "loss"}
    assert "teacher" not in dict(loss_fn.named_modules())  # not part of any state_dict / optimizer
    with pytest.raises(ValueError, match="alpha"):
        KDLoss(teacher, alpha=1.5)


def test_feature_loss_with_projection_trains_the_projection():
    torch.manual_seed(0)
    student = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 3))
    teacher = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 64, 3))
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="projection"):
        bad = FeatureLoss(student, teacher, {"1": "1"})
        student(x), teacher(x)
        bad.feature_loss()
    bad.remove()
    d = Distiller(student, teacher, T=2, alpha=0.5, features={"1": "1"}, projection=True, example_inputs=(x,))
    assert len(d.features.proj) == 1
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    first = None
    for _ in range(20):
        opt.zero_grad()
        loss = d.loss(x, y)
        loss.backward()
        opt.step()
        first = first if first is not None else float(d.last["features"])
    assert float(d.last["features"]) < first
    assert {"task", "kd", "features", "loss"} <= set(d.last)
    with pytest.raises(KeyError, match="not found"):
        FeatureLoss(student, teacher, {"nope": "1"})


def test_qat_student_with_float_teacher_in_a_plain_loop():
    """The README route: loss_fn = KDLoss(teacher, T=4, alpha=0.5); loss = loss_fn(out, y, x)."""
    import copy

    from dal_examples.datasets import mnist_loaders
    from dal_examples.training import accuracy, train_epoch
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)
    train, test = mnist_loaders(batch_size=64, train_limit=1024, test_limit=256)
    teacher = MnistCNN(width=8)
    train_epoch(teacher, train, torch.optim.SGD(teacher.parameters(), lr=0.05, momentum=0.9))
    student = dal.prepare_qat(copy.deepcopy(teacher), "int8_balanced", "a2000",
                              example_inputs=(torch.zeros(1, 1, 28, 28),))
    dal.calibrate(student, train, num_batches=4, progress=False)
    loss_fn = KDLoss(teacher, T=4, alpha=0.5)
    loss = train_epoch(student, train, torch.optim.SGD(student.parameters(), lr=0.01, momentum=0.9),
                       max_batches=8, loss_fn=loss_fn)
    assert math.isfinite(loss) and accuracy(student, test) > 50
    assert float(loss_fn.last["kd"]) >= 0


def test_callback_distills_and_logs_both_losses(tmp_path):
    pytest.importorskip("pytorch_lightning")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "lightning"))
    from lit_common import LitMnist, mnist_subset, pretrained_state, trainer

    from dal.lightning import QATCallback
    from dal_examples.zoo import MnistCNN

    teacher = MnistCNN(width=8)
    teacher.load_state_dict(pretrained_state(8))
    train, _ = mnist_subset(n_train=256)
    cb = QATCallback("int8_balanced", "a2000", calibrate_batches=2, teacher=teacher,
                     distill=dict(T=4, alpha=0.5, features={"down2.0": "down2.0"}, projection=False),
                     example_inputs=torch.zeros(1, 1, 28, 28))
    module = LitMnist()
    t = trainer(tmp_path, "kd", max_epochs=1, callbacks=[cb], log_every_n_steps=1)
    t.fit(module, train)
    with open(f"{t.logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    cols = set().union(*[r.keys() for r in rows])
    for key in ("dal/kd_task_loss_epoch", "dal/kd_loss_epoch", "dal/kd_feature_loss_epoch", "train_loss"):
        assert key in cols, sorted(cols)
    assert all(p.grad is None for p in teacher.parameters())  # taught, never trained
    assert not any(n.startswith("teacher") for n in module.state_dict())
