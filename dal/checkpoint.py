"""A dal checkpoint: the plain ``state_dict`` plus the recipe and hardware it was prepared with.

``prepare_qat`` on a fresh float model, then ``load_state_dict``, restores a QAT model exactly;
these two functions just keep the recipe next to the weights so that nobody has to remember it.
"""
from __future__ import annotations

import importlib
import os
from typing import Callable, Union

import torch
from torch import nn


def save_checkpoint(model: nn.Module, path: Union[str, os.PathLike], **extra) -> None:
    """Write ``{"state_dict", "recipe", "hardware", "dal_version", **extra}`` with ``torch.save``.

    The recipe and the hardware model are stored as plain dicts (``to_dict()``): a custom or
    edited hardware model (its requantizer, say) comes back as it was, not as the bundled model
    of the same name.
    """
    import dal

    from .prepare.handle import find_prepared

    handle = find_prepared(model)
    recipe, hardware = (handle.recipe, handle.hardware) if handle is not None else (None, None)
    if recipe is None:
        raise ValueError("save_checkpoint: the model was not prepared with dal.prepare_qat (no recipe attached)")
    torch.save({"state_dict": model.state_dict(), "recipe": recipe.to_dict(),
                "hardware": hardware.to_dict() if hardware is not None else None, "dal_version": dal.__version__, **extra}, str(path))


def resolve_factory(spec: Union[str, Callable[[], nn.Module]]) -> Callable[[], nn.Module]:
    """``"package.module:function"`` (or a callable) -> a zero-argument model factory."""
    if callable(spec):
        return spec
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"model factory {spec!r} must look like 'package.module:function' "
                         "(for example dal.zoo:MnistCNN or torchvision.models:resnet18)")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model factory {spec!r} cannot be loaded: {err}") from err
    return obj


def load_checkpoint(path: Union[str, os.PathLike], model_factory, example_inputs=None) -> nn.Module:
    """Build the float model, ``prepare_qat`` it with the stored recipe and hardware, load the
    weights, quantizer parameters and states; returns the QAT model in eval mode."""
    import dal

    factory = resolve_factory(model_factory)  # a typo in the factory is reported before any I/O
    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - torch.load's errors for a file it did not write vary
        raise ValueError(f"{path} is not a dal checkpoint: torch.load cannot read it ({type(err).__name__}); "
                         "write it with dal.save_checkpoint") from err
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path} is not a dal checkpoint: it holds a {type(ckpt).__name__}, not the dict "
                         "dal.save_checkpoint writes")
    missing = [k for k in ("state_dict", "recipe") if k not in ckpt]
    if missing:
        raise ValueError(f"{path} is not a dal checkpoint: it lacks {missing} (write it with dal.save_checkpoint)")
    model = factory()
    model = dal.prepare_qat(model, recipe=ckpt["recipe"], hardware=ckpt.get("hardware"), example_inputs=example_inputs)
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()
