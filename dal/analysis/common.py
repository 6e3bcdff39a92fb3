"""What the analyses share: the QAT layers of a model, switching their quantizers, cached batches."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..nest import tensors
from ..nn.base import QATModule
from ..nn.modes import eval_mode
from ..quantizer import FakeQuantizer, quantizer_states, quantizers

ACTIVE = ("quantize", "frozen")


def qat_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every QAT module (``dal.nn.QATModule``), in registration order."""
    return [(name, mod) for name, mod in model.named_modules() if name and isinstance(mod, QATModule)]


def layer_quantizers(mod: nn.Module) -> list[FakeQuantizer]:
    return [m for m in mod.modules() if isinstance(m, FakeQuantizer)]


def active_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """QAT layers with at least one quantizer quantizing (or frozen); raises while any observes."""
    observing = [n for n, q in quantizers(model) if q.state == "observe"]
    if observing:
        shown = ", ".join(observing[:8]) + (" ..." if len(observing) > 8 else "")
        raise ValueError(f"{len(observing)} quantizer(s) are still observing ({shown}): "
                         "calibrate the model (dal.calibrate) before analysing it")
    return [(n, m) for n, m in qat_layers(model) if any(q.state in ACTIVE for q in layer_quantizers(m))]


@contextlib.contextmanager
def evaluating(*models: nn.Module) -> Iterator[None]:
    """Eval mode, no grad, and every quantizer's state put back afterwards (without recomputing
    scales), whatever the analysis switched on or off meanwhile."""
    with contextlib.ExitStack() as stack, torch.no_grad():
        for m in models:
            if m is not None:
                stack.enter_context(quantizer_states(m))
                stack.enter_context(eval_mode(m))
        yield


def switch(qs, state: str) -> None:
    """Set quantizers to ``state`` ("off", or back to what one was): ``set_state``, no scale
    recomputed."""
    for q in qs:
        q.set_state(state)


def flat_outputs(out) -> list[torch.Tensor]:
    """The tensors of a model output, any nest (tensor, tuple / list, dict, dataclass, HF
    ``ModelOutput``), in dal.nest's order: the order of the exported file's outputs."""
    return tensors(out)
