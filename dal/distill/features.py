"""Intermediate-feature distillation: MSE between named module outputs of student and teacher.

    feat = sum over pairs (s_name, t_name) of  MSE( proj(s_out), t_out )

Outputs are captured with forward hooks, so neither model's forward changes. When a student
feature has a different channel count than its teacher feature, ``projection=True`` adds a
learnable 1x1 conv (4-D features) or linear map (2-D / 3-D, last axis) from student to teacher
channels (FitNets, Romero et al. 2015); its parameters belong to this module and must be given
to the optimizer (``optimizer = SGD(list(student.parameters()) + list(feat.parameters()))``).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.modes import eval_mode


class FeatureCapture:
    """Forward hooks that keep the latest output of named submodules of ``model``.

    ``capture.outputs[name]`` is the output of the last call; ``capture.remove()`` removes the
    hooks. Unknown names raise, listing what the model has.
    """

    def __init__(self, model: nn.Module, names):
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            sample = ", ".join(list(modules)[1:25])
            raise KeyError(f"feature distillation: {missing} not found in {type(model).__name__}; module names "
                           f"are those of named_modules() (after prepare_qat for the student): {sample} ...")
        self.outputs: dict = {}
        self._handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name):
        def hook(module, args, out):
            self.outputs[name] = out
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _projection(s_shape, t_shape) -> Optional[nn.Module]:
    if tuple(s_shape) == tuple(t_shape):
        return None
    if len(s_shape) == 4 and len(t_shape) == 4:
        if s_shape[2:] != t_shape[2:]:
            raise ValueError(f"feature shapes {tuple(s_shape)} vs {tuple(t_shape)}: a 1x1 projection cannot "
                             "change the spatial size; pick layers of the same resolution")
        return nn.Conv2d(s_shape[1], t_shape[1], 1, bias=False)
    if len(s_shape) == len(t_shape) and s_shape[:-1] == t_shape[:-1]:
        return nn.Linear(s_shape[-1], t_shape[-1], bias=False)
    raise ValueError(f"feature shapes {tuple(s_shape)} vs {tuple(t_shape)} cannot be matched by a projection")


class FeatureLoss(nn.Module):
    """MSE between student and teacher features (see the module docstring).

    Args:
        student, teacher: the two models; hooks are installed on both right away.
        pairs: ``{student_module_name: teacher_module_name}``.
        projection: add learnable projections where shapes differ; they are built from one dry
            run of ``example_inputs`` through both models (so they exist before the optimizer).
        example_inputs: a tuple of inputs for that dry run (needed only with ``projection``).

    Call ``feature_loss()`` after both models have run on the same batch (the teacher under
    ``no_grad``): it returns the summed MSE over the pairs.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, pairs: Mapping[str, str],
                 projection: bool = False, example_inputs=None):
        super().__init__()
        if not pairs:
            raise ValueError("FeatureLoss: pairs is empty; give {student_module: teacher_module}")
        self.pairs = dict(pairs)
        self.student_capture = FeatureCapture(student, list(self.pairs))
        self.teacher_capture = FeatureCapture(teacher, list(self.pairs.values()))
        self.proj = nn.ModuleDict()
        if projection:
            if example_inputs is None:
                raise ValueError("FeatureLoss(projection=True) needs example_inputs to size the projections")
            args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            with torch.no_grad():
                with eval_mode(student):
                    student(*args)
                teacher(*args)
            for s_name, t_name in self.pairs.items():
                p = _projection(self.student_capture.outputs[s_name].shape,
                                self.teacher_capture.outputs[t_name].shape)
                if p is not None:
                    self.proj[_key(s_name)] = p

    def feature_loss(self) -> torch.Tensor:
        total = None
        for s_name, t_name in self.pairs.items():
            if s_name not in self.student_capture.outputs or t_name not in self.teacher_capture.outputs:
                raise RuntimeError(f"FeatureLoss: no output captured for {s_name!r} / {t_name!r}: run both models "
                                   "on the batch before asking for the loss")
            s = self.student_capture.outputs[s_name]
            t = self.teacher_capture.outputs[t_name].detach()
            key = _key(s_name)
            if key in self.proj:
                s = self.proj[key](s)
            if s.shape != t.shape:
                raise ValueError(f"feature {s_name!r} {tuple(s.shape)} vs teacher {t_name!r} {tuple(t.shape)}: "
                                 "shapes differ; pass projection=True")
            term = F.mse_loss(s.float(), t.float())
            total = term if total is None else total + term
        return total

    def remove(self) -> None:
        self.student_capture.remove()
        self.teacher_capture.remove()


def _key(name: str) -> str:
    return name.replace(".", "__") or "root"  # ModuleDict keys may not contain dots
