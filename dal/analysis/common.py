"""What the analyses share: the QAT layers of a model, switching their quantizers, cached batches."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..calibration.methods import set_state_code
from ..nn.modes import eval_mode
from ..prepare.state import quantizers
from ..quantizer import FakeQuantizer

ACTIVE = ("quantize", "frozen")


def qat_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every QAT module (anything with ``qat_name``), in registration order."""
    return [(name, mod) for name, mod in model.named_modules() if name and hasattr(mod, "qat_name")]


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
    saved = [(m, [(q, q.state) for _, q in quantizers(m)]) for m in models if m is not None]
    try:
        with contextlib.ExitStack() as stack, torch.no_grad():
            for m, _ in saved:
                stack.enter_context(eval_mode(m))
            yield
    finally:
        for m, states in saved:
            for q, s in states:
                set_state_code(q, s)


def switch(qs, state: str) -> None:
    """Set quantizers to ``state`` ("off", or back to what they were via a dict q -> state)."""
    for q in qs:
        set_state_code(q, state)


def flat_outputs(out) -> list[torch.Tensor]:
    """The tensors of a model output (a tensor, a tuple / list, or a dict of them), in order."""
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat_outputs(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in flat_outputs(v)]
    return []
