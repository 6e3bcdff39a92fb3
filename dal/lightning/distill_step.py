"""Distillation inside a LightningModule's own training_step, without editing it.

The callback wraps ``training_step`` on the instance: a forward hook on the student records
the inputs and output of its last call while the step runs, and the loss the step returns is
replaced by ``(1 - alpha) * loss + alpha * T^2 * KL(teacher || student)`` (+ feature MSE). The
step's own loss plays the role of the task loss, so whatever the user computes (CE, label
smoothing, ...) is kept.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from ..distill import FeatureLoss, KDLoss
from ..distill.kd import follow_device, logits_of


class DistillStep:
    """Owns the KD loss, the student hook and the wrapped ``training_step``."""

    def __init__(self, teacher: nn.Module, T: float = 4.0, alpha: float = 0.5, features=None,
                 feature_weight: float = 1.0, projection: bool = False):
        self.kd = KDLoss(teacher, T=T, alpha=alpha)
        self.features_cfg = dict(features) if features else None
        self.feature_weight = float(feature_weight)
        self.projection = projection
        self.feature_loss: Optional[FeatureLoss] = None
        self._capturing = False
        self._seen = None
        self._handle = None

    def attach(self, pl_module: nn.Module, student: nn.Module, example_inputs) -> None:
        """Hook ``student`` and wrap ``pl_module.training_step`` (idempotent: the wrapper carries
        ``dal_distill = True``, and a training_step that carries it is not wrapped again)."""
        if self._handle is None:
            self._handle = student.register_forward_hook(self._record, with_kwargs=True)
        if self.features_cfg and self.feature_loss is None:
            self.feature_loss = FeatureLoss(student, self.kd.teacher, self.features_cfg, self.projection,
                                            example_inputs)
            if len(self.feature_loss.proj):
                # Registered on the LightningModule so configure_optimizers (called after setup)
                # sees the projections through self.parameters(), and checkpoints keep them.
                pl_module.dal_feature_proj = self.feature_loss.proj
        if getattr(pl_module.training_step, "dal_distill", False):
            return
        original = pl_module.training_step

        @functools.wraps(original)
        def training_step(*args, **kwargs):
            return self._step(pl_module, original, *args, **kwargs)

        training_step.dal_distill = True
        pl_module.training_step = training_step

    def _record(self, module, args, kwargs, out):
        if self._capturing and module.training:
            self._seen = (args, kwargs, out)

    def _step(self, pl_module, original, *args, **kwargs):
        self._capturing, self._seen = True, None
        try:
            out = original(*args, **kwargs)
        finally:
            self._capturing = False
        if out is None:
            return out
        task = out["loss"] if isinstance(out, dict) else out
        if self._seen is None:
            raise RuntimeError("QATCallback(teacher=...): training_step never called the quantized network in "
                               "train mode, so there is nothing to distill; check model_attr")
        s_args, s_kwargs, s_out = self._seen
        self._seen = None
        with torch.no_grad():
            follow_device(self.kd.teacher, s_args)
            self.kd.teacher.eval()
            t_out = self.kd.teacher(*s_args, **s_kwargs)
        loss = self.kd.blend(task, s_out, teacher_logits=logits_of(t_out))
        logs = {"dal/kd_task_loss": self.kd.last["task"], "dal/kd_loss": self.kd.last["kd"]}
        if self.feature_loss is not None:
            feat = self.feature_loss.feature_loss()
            loss = loss + self.feature_weight * feat
            logs["dal/kd_feature_loss"] = feat.detach()
        pl_module.log_dict(logs, on_step=True, on_epoch=True)
        if isinstance(out, dict):
            out = dict(out)
            out["loss"] = loss
            return out
        return loss

