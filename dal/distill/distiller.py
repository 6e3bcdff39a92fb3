"""Distiller: the student, its teacher and the distillation losses behind one call, for plain loops."""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
from torch import nn

from .features import FeatureLoss
from .kd import KDLoss, logits_of


class Distiller(nn.Module):
    """Run student and teacher on the same batch and return the blended loss.

        loss = (1 - alpha) * task(s, y) + alpha * T^2 * KL(t || s) + feature_weight * sum MSE(features)

    Args:
        student: the QAT model being trained (its parameters are this module's parameters,
            together with the feature projections, if any).
        teacher: the float model (eval mode, gradients off).
        T, alpha, task_loss, class_dim: as for :class:`KDLoss` (``class_dim=-1`` for a language
            model's ``[N, L, vocab]`` logits).
        features: optional ``{student_module: teacher_module}`` for feature MSE.
        feature_weight: weight of the feature term.
        projection, example_inputs: as for :class:`FeatureLoss`.

    Example::

        d = dal.distill.Distiller(qat_model, float_model, T=4, alpha=0.5)
        opt = torch.optim.SGD(d.parameters(), lr=0.01)
        for x, y in loader:
            loss = d.loss(x, y)          # runs both models
            loss.backward(); opt.step(); opt.zero_grad()

    ``d.last`` holds the detached components (task, kd, features, loss) of the last call.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, T: float = 4.0, alpha: float = 0.5,
                 task_loss: Optional[Callable] = None, features: Optional[Mapping[str, str]] = None,
                 feature_weight: float = 1.0, projection: bool = False, example_inputs=None,
                 class_dim: int = 1):
        super().__init__()
        self.student = student
        self.kd = KDLoss(teacher, T=T, alpha=alpha, task_loss=task_loss, class_dim=class_dim)
        self.features = (FeatureLoss(student, teacher, features, projection, example_inputs)
                         if features else None)
        self.feature_weight = float(feature_weight)
        self.last: dict = {}

    @property
    def teacher(self) -> nn.Module:
        return self.kd.teacher

    def forward(self, *inputs):
        """The student's output (what inference sees); the teacher does not run."""
        return self.student(*inputs)

    def loss(self, inputs, targets) -> torch.Tensor:
        """Student and teacher on ``inputs`` (a tensor or tuple); the blended loss against ``targets``."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        s = logits_of(self.student(*args))
        t = self.kd.teacher_logits(args)  # no_grad; also fills the teacher's feature hooks
        loss = self.kd(s, targets, teacher_logits=t)
        self.last = dict(self.kd.last)
        if self.features is not None:
            feat = self.features.feature_loss()
            loss = loss + self.feature_weight * feat
            self.last.update(features=feat.detach(), loss=loss.detach())
        return loss
