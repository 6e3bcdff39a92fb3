"""Knowledge distillation for QAT: the float model teaches its quantized copy.

* :func:`kd_divergence` — ``T^2 * KL(softmax(t/T) || softmax(s/T))``;
* :class:`KDLoss` — that term blended with the task loss, ``loss_fn(student_logits, y, x)``;
* :class:`FeatureLoss` — MSE between named intermediate outputs (hooks, optional projection);
* :class:`Distiller` — student + teacher + both losses for a plain training loop.

The Lightning route is ``dal.lightning.QATCallback(..., teacher=float_model)``.
"""
from .distiller import Distiller
from .features import FeatureCapture, FeatureLoss
from .kd import KDLoss, kd_divergence

__all__ = ["KDLoss", "kd_divergence", "FeatureLoss", "FeatureCapture", "Distiller"]
