"""Which network inside a LightningModule the callback quantizes, and its example inputs."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def resolve_model_attr(pl_module: nn.Module, model_attr: Optional[str], exclude=()) -> Optional[str]:
    """The attribute of ``pl_module`` holding the network to quantize; ``None`` = the module itself.

    Rule (documented on :class:`QATCallback`): an explicit ``model_attr`` wins (``""`` means the
    LightningModule itself); otherwise ``model`` if it is an ``nn.Module``; otherwise the first
    child module that has parameters (skipping ``exclude``, e.g. the teacher); otherwise the
    LightningModule itself.
    """
    if model_attr is not None:
        if model_attr == "":
            return None
        mod = getattr(pl_module, model_attr, None)
        if not isinstance(mod, nn.Module):
            children = ", ".join(n for n, _ in pl_module.named_children()) or "(none)"
            raise AttributeError(f"QATCallback(model_attr={model_attr!r}): {type(pl_module).__name__} has no "
                                 f"nn.Module attribute {model_attr!r}; its child modules are: {children}")
        return model_attr
    if isinstance(getattr(pl_module, "model", None), nn.Module):
        return "model"
    skip = {id(m) for m in exclude if m is not None}
    for name, child in pl_module.named_children():
        if id(child) not in skip and any(True for _ in child.parameters()):
            return name
    return None


def get_target(pl_module: nn.Module, attr: Optional[str]) -> nn.Module:
    return pl_module if attr is None else getattr(pl_module, attr)


def set_target(pl_module: nn.Module, attr: Optional[str], model: nn.Module) -> None:
    if attr is None:
        if model is not pl_module:
            raise RuntimeError(
                f"prepare_qat rewrote {type(pl_module).__name__}'s own forward (it contains +, cat or matmul) "
                "and returned a new module, which cannot replace the LightningModule: keep the network in "
                "an attribute (self.model = ...) and pass QATCallback(model_attr='model')")
        return
    setattr(pl_module, attr, model)


def as_tuple(inputs) -> Optional[tuple]:
    if inputs is None:
        return None
    if torch.is_tensor(inputs):
        return (inputs,)
    if isinstance(inputs, list):
        return tuple(inputs)
    if isinstance(inputs, tuple):
        return inputs
    raise TypeError(f"example inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}")


def first_sample(args: tuple) -> tuple:
    """One sample (batch of 1) of each batched tensor, on the CPU: small enough for a checkpoint."""
    return tuple(a[:1].detach().cpu().clone() if torch.is_tensor(a) and a.dim() > 0 else a for a in args)
