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


def kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, T: float = 4.0,
                  class_dim: int = 1, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over the class axis, averaged
    over the samples: every position of the other axes counts as one sample.

    ``class_dim`` is the class axis: 1 for ``[N, C]`` or ``[N, C, ...]`` (dense prediction);
    ``-1`` for a language model's ``[N, L, vocab]`` logits (one sample per token). ``mask``
    (optional, the logits' shape without the class axis, e.g. an HF ``attention_mask``
    ``[N, L]``) keeps the positions where it is nonzero: the mean is over those only. The
    teacher side carries no gradient.

    >>> kd_divergence(torch.zeros(2, 3), torch.zeros(2, 3))
    tensor(0.)
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"kd_divergence: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape; distill models with the same outputs")
    if not -student_logits.dim() <= class_dim < student_logits.dim():
        raise ValueError(f"kd_divergence: class_dim={class_dim} is not an axis of logits of shape "
                         f"{tuple(student_logits.shape)}")
    s = student_logits.float().movedim(class_dim, -1)  # [..., C]
    t = teacher_logits.detach().float().movedim(class_dim, -1)
    classes = s.shape[-1]
    s, t = s.reshape(-1, classes), t.reshape(-1, classes)  # one row per sample
    if mask is not None:
        if tuple(mask.shape) != tuple(student_logits.movedim(class_dim, -1).shape[:-1]):
            raise ValueError(f"kd_divergence: mask of shape {tuple(mask.shape)} must have the logits' shape "
                             f"{tuple(student_logits.shape)} without the class axis {class_dim}")
        keep = mask.reshape(-1).to(s.device) != 0
        if not bool(keep.any()):
            raise ValueError("kd_divergence: the mask keeps no position; there is nothing to distill")
        s, t = s[keep], t[keep]
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
        task_loss: ``(student_logits, targets) -> loss``; by default cross-entropy over
            ``class_dim``.
        class_dim: the logits' class axis (``kd_divergence``): 1 for ``[N, C, ...]``, ``-1``
            for a language model's ``[N, L, vocab]``.

    Call: ``loss = loss_fn(student_logits, targets, inputs)`` returns
    ``(1 - alpha) * task + alpha * T^2 * KL``; the last components are in ``loss_fn.last``
    (``{"task": ..., "kd": ..., "loss": ...}``, detached) for logging.

    Example (a plain loop)::

        loss_fn = dal.distill.KDLoss(float_model, T=4, alpha=0.5)
        for x, y in loader:
            loss = loss_fn(qat_model(x), y, x)
            loss.backward(); opt.step(); opt.zero_grad()

    A causal LM (HuggingFace outputs are taken as they are: ``logits_of``), distillation alone
    or blended with the model's own loss (``labels=``), padding left out by ``mask``::

        loss_fn = dal.distill.KDLoss(float_llm, T=1, alpha=1, class_dim=-1)
        out = qat_llm(ids, attention_mask=am, labels=ids)
        loss = loss_fn.blend(out.loss, out, ids, mask=am)

    The teacher is deliberately not a registered submodule: it stays out of the student's
    ``state_dict``, its optimizer and DDP's gradient buckets.
    """

    def __init__(self, teacher: Optional[nn.Module] = None, T: float = 4.0, alpha: float = 0.5,
                 task_loss: Optional[Callable] = None, class_dim: int = 1):
        super().__init__()
        if not T > 0:
            raise ValueError(f"KDLoss: T={T} must be > 0")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"KDLoss: alpha={alpha} must be in [0, 1]")
        self.__dict__["teacher"] = _frozen(teacher) if teacher is not None else None
        self.T, self.alpha = float(T), float(alpha)
        self.class_dim = int(class_dim)
        self.task_loss = task_loss or self._cross_entropy
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

    def _cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.movedim(self.class_dim, 1), targets)

    def distill_term(self, student_logits: torch.Tensor, inputs=None,
                     teacher_logits: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
        """``T^2 * KL(teacher || student)`` alone (no task loss, no alpha), over ``class_dim``,
        averaged over the positions ``mask`` keeps (all when None). Either argument may be a
        model output (``logits_of``)."""
        t = teacher_logits if teacher_logits is not None else self.teacher_logits(inputs)
        return kd_divergence(logits_of(student_logits), logits_of(t), self.T, self.class_dim, mask)

    def blend(self, task: torch.Tensor, student_logits: torch.Tensor, inputs=None,
              teacher_logits: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``(1 - alpha) * task + alpha * distill_term``: mixes a task loss computed elsewhere
        (e.g. by a LightningModule's ``training_step``, or an HF model's ``labels=`` loss) with
        the distillation term."""
        kd = self.distill_term(student_logits, inputs, teacher_logits, mask)
        loss = (1.0 - self.alpha) * task + self.alpha * kd
        self.last = {"task": task.detach(), "kd": kd.detach(), "loss": loss.detach()}
        return loss

    def forward(self, student_logits: torch.Tensor, targets: torch.Tensor, inputs=None,
                teacher_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        task = self.task_loss(logits_of(student_logits), targets)
        return self.blend(task, student_logits, inputs, teacher_logits)

    def extra_repr(self) -> str:
        return f"T={self.T}, alpha={self.alpha}, class_dim={self.class_dim}, teacher={type(self.teacher).__name__ if self.teacher else None}"


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
