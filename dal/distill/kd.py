"""Knowledge distillation on logits (Hinton et al. 2015): the float model teaches its QAT copy.

    kd(s, t)  = T^2 * KL( softmax(t / T) || softmax(s / T) )        (batch mean)
    loss      = (1 - alpha) * task(s, y) + alpha * kd(s, t)

The ``T^2`` factor keeps the gradient of the soft term on the scale of the hard one when the
temperature changes (the soft gradients shrink as ``1 / T^2``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


def kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 4.0) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))``, averaged over the batch.

    The class axis is 1 (``[N, C]`` or ``[N, C, ...]`` for dense prediction, where every
    position counts as a sample). The teacher side carries no gradient.

    >>> kd_divergence(torch.zeros(2, 3), torch.zeros(2, 3))
    tensor(0.)
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"kd_divergence: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape; distill models with the same outputs")
    s = student_logits.float()
    t = teacher_logits.detach().float()
    if s.dim() > 2:  # [N, C, ...] -> [N * positions, C]
        s = s.movedim(1, -1).reshape(-1, s.shape[1])
        t = t.movedim(1, -1).reshape(-1, t.shape[1])
    log_p_s = F.log_softmax(s / T, dim=1)
    log_p_t = F.log_softmax(t / T, dim=1)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True) * (T * T)


class KDLoss(nn.Module):
    """Logit distillation blended with the task loss.

    Args:
        teacher: the float model (put in eval mode and run under ``no_grad``; it is not
            trained, and its ``requires_grad`` flags are left alone). It runs on ``inputs``
            unless ``teacher_logits`` are passed to the call.
        T: temperature (> 0).
        alpha: weight of the distillation term in [0, 1]; ``0`` is plain task training.
        task_loss: ``(student_logits, targets) -> loss``; cross-entropy by default.

    Call: ``loss = loss_fn(student_logits, targets, inputs)`` returns
    ``(1 - alpha) * task + alpha * T^2 * KL``; the last components are in ``loss_fn.last``
    (``{"task": ..., "kd": ..., "loss": ...}``, detached) for logging.

    Example (a plain loop)::

        loss_fn = dal.distill.KDLoss(float_model, T=4, alpha=0.5)
        for x, y in loader:
            loss = loss_fn(qat_model(x), y, x)
            loss.backward(); opt.step(); opt.zero_grad()

    The teacher is deliberately not a registered submodule: it stays out of the student's
    ``state_dict``, its optimizer and DDP's gradient buckets.
    """

    def __init__(self, teacher: Optional[nn.Module] = None, T: float = 4.0, alpha: float = 0.5,
                 task_loss: Optional[Callable] = None):
        super().__init__()
        if not T > 0:
            raise ValueError(f"KDLoss: T={T} must be > 0")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"KDLoss: alpha={alpha} must be in [0, 1]")
        self.__dict__["teacher"] = _frozen(teacher) if teacher is not None else None
        self.T, self.alpha = float(T), float(alpha)
        self.task_loss = task_loss or F.cross_entropy
        self.last: dict = {}

    @torch.no_grad()
    def teacher_logits(self, inputs) -> torch.Tensor:
        """The teacher's output for ``inputs`` (a tensor or a tuple of positional inputs)."""
        if self.teacher is None:
            raise ValueError("KDLoss: no teacher was given; pass teacher=... or teacher_logits=...")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        follow_device(self.teacher, args)
        self.teacher.eval()  # a Trainer or user loop may have flipped it back to train mode
        out = self.teacher(*args)
        return logits_of(out)

    def distill_term(self, student_logits: torch.Tensor, inputs=None,
                     teacher_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``T^2 * KL(teacher || student)`` alone (no task loss, no alpha)."""
        t = teacher_logits if teacher_logits is not None else self.teacher_logits(inputs)
        return kd_divergence(logits_of(student_logits), t, self.T)

    def blend(self, task: torch.Tensor, student_logits: torch.Tensor, inputs=None,
              teacher_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``(1 - alpha) * task + alpha * distill_term``: mixes a task loss computed elsewhere
        (e.g. by a LightningModule's ``training_step``) with the distillation term."""
        kd = self.distill_term(student_logits, inputs, teacher_logits)
        loss = (1.0 - self.alpha) * task + self.alpha * kd
        self.last = {"task": task.detach(), "kd": kd.detach(), "loss": loss.detach()}
        return loss

    def forward(self, student_logits: torch.Tensor, targets: torch.Tensor, inputs=None,
                teacher_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        task = self.task_loss(logits_of(student_logits), targets)
        return self.blend(task, student_logits, inputs, teacher_logits)

    def extra_repr(self) -> str:
        return f"T={self.T}, alpha={self.alpha}, teacher={type(self.teacher).__name__ if self.teacher else None}"


def logits_of(out):
    """The logits of a model output: the tensor itself, the first element of a tuple, or the
    ``"logits"`` entry of a dict (HuggingFace style); TypeError otherwise. Used for student and
    teacher outputs alike (KDLoss, Distiller, the Lightning distillation step)."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    if isinstance(out, (list, tuple)) and out and torch.is_tensor(out[0]):
        return out[0]
    raise TypeError(f"cannot find logits in a model output of type {type(out).__name__}: return a tensor, "
                    "a tuple whose first element is the logits, or a dict with 'logits'")


def _frozen(teacher: nn.Module) -> nn.Module:
    # Only eval mode: the teacher always runs under no_grad, and flipping requires_grad on the
    # user's model would silently freeze any later copy of it (a QAT student made by deepcopy).
    return teacher.eval()


def follow_device(module: nn.Module, args) -> None:
    """Move ``module`` (the teacher) to the device of the first tensor in ``args``, if it is
    elsewhere: a Trainer moves the student, not the teacher."""
    t = next((a for a in args if torch.is_tensor(a)), None)
    p = next(module.parameters(), None)
    if t is not None and p is not None and p.device != t.device:
        module.to(t.device)
