"""What a QAT checkpoint carries besides the weights, and restoring one without a Trainer.

``checkpoint["dal"]`` (written by ``QATCallback.on_save_checkpoint``)::

    {"version": dal.__version__, "recipe": Recipe.to_dict(), "hardware": HardwareModel.to_dict() | None,
     "model_attr": "model" | None, "example_inputs": (one CPU sample per input,) | None,
     "quantize_outputs": True | False | None}

That is everything ``prepare_qat`` needs to rebuild the same module tree (same quantizers,
same output quantizers) before ``load_state_dict`` restores scales, zero points, observer
statistics and states exactly (DESIGN.md: a checkpoint is a plain state_dict plus the recipe).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

KEY = "dal"


def make_payload(recipe, hardware, model_attr: Optional[str], example_inputs,
                 quantize_outputs: Optional[bool] = None) -> dict:
    import dal

    return {"version": dal.__version__, "recipe": recipe.to_dict(),
            "hardware": hardware.to_dict() if hardware is not None else None,
            "model_attr": model_attr, "example_inputs": example_inputs, "quantize_outputs": quantize_outputs}


def check_payload(payload: Optional[dict], recipe, hardware, where: str) -> None:
    """Refuse a checkpoint trained with another recipe or hardware model than the callback's:
    the module trees would differ and scales would land on the wrong quantizers."""
    if payload is None:
        raise ValueError(f"{where} has no 'dal' entry: it was not written by a run with dal.lightning.QATCallback; "
                         "load its weights into the float model instead")
    if payload.get("recipe") != recipe.to_dict():
        raise ValueError(f"{where} was trained with recipe {payload.get('recipe', {}).get('name')!r}, but the "
                         f"QATCallback uses {recipe.name!r} (or a modified copy); pass the same recipe to resume")
    mine = hardware.to_dict() if hardware is not None else None
    if payload.get("hardware") != mine:
        theirs = (payload.get("hardware") or {}).get("name")
        raise ValueError(f"{where} was trained for hardware {theirs!r}, but the QATCallback targets "
                         f"{getattr(hardware, 'name', None)!r}; pass the same hardware to resume")


def restore_qat_checkpoint(pl_module: nn.Module, checkpoint, strict: bool = True) -> nn.Module:
    """Prepare ``pl_module``'s network with the checkpoint's recipe and hardware, then load its
    weights: the Trainer-free counterpart of ``Trainer.test(ckpt_path=...)``.

    ``checkpoint`` is a path or an already loaded dict. Returns ``pl_module``.

    Example::

        module = MyLitModule()                                  # float, as constructed
        dal.lightning.restore_qat_checkpoint(module, "epoch=1.ckpt")
        dal.export_onnx(module.model, (x,), "model.onnx")
    """
    from ..prepare import prepare_qat
    from .target import get_target, set_target

    ckpt = checkpoint if isinstance(checkpoint, dict) else torch.load(checkpoint, map_location="cpu",
                                                                       weights_only=False)
    payload = ckpt.get(KEY)
    if payload is None:
        raise ValueError("restore_qat_checkpoint: the checkpoint has no 'dal' entry (not written by QATCallback)")
    attr = payload.get("model_attr")
    inner = get_target(pl_module, attr)
    prepared = prepare_qat(inner, recipe=payload["recipe"], hardware=payload["hardware"],
                           example_inputs=payload.get("example_inputs"),
                           quantize_outputs=payload.get("quantize_outputs"))
    set_target(pl_module, attr, prepared)
    pl_module.load_state_dict(ckpt["state_dict"], strict=strict)
    return pl_module
