"""DistillStep.attach wraps a LightningModule's training_step once, however often it is attached
(its mark is on its own wrapper function, not on the user's module)."""
import pytest
import torch
from torch import nn

pytest.importorskip("pytorch_lightning")

from dal.lightning.distill_step import DistillStep  # noqa: E402


class Lit(nn.Module):
    """The part of a LightningModule that DistillStep uses: training_step and log_dict."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.logged = []

    def training_step(self, x):
        return self.net(x).pow(2).mean()

    def log_dict(self, logs, **kwargs):
        self.logged.append(logs)


def test_attaching_twice_wraps_the_training_step_once():
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
    lit = Lit(student).train()
    original = lit.training_step
    step = DistillStep(teacher, T=2.0, alpha=0.25)
    step.attach(lit, student, None)
    step.attach(lit, student, None)
    assert lit.training_step.__wrapped__ == original  # wrapped once: the wrapper wraps the user's method
    assert not hasattr(lit, "_dal_distill_wrapped") and "dal_distill" not in vars(lit)
    loss = lit.training_step(torch.randn(5, 4))
    assert len(lit.logged) == 1 and set(lit.logged[0]) == {"dal/kd_task_loss", "dal/kd_loss"}
    assert loss.requires_grad
