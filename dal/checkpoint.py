"""A dal checkpoint: the plain ``state_dict`` plus the recipe and hardware it was prepared with.

``prepare_qat`` on a fresh float model, then ``load_state_dict``, restores a QAT model exactly;
these functions keep the recipe next to the weights so that nobody has to remember it, and record
which model wrote the file (its class and a fingerprint of its parameters) so that loading into
another model is named as such, not left to torch's "Unexpected key(s)".
"""
from __future__ import annotations

import hashlib
import importlib
import os
from typing import Callable, Union

import torch
from torch import nn


def model_class(model: nn.Module) -> str:
    """The model's class as a checkpoint records it: ``module.QualName``; a prepared root that
    ``prepare_qat`` traced into a ``torch.fx.GraphModule`` carries its float class's name only."""
    cls = type(model)
    if isinstance(model, torch.fx.GraphModule):
        return cls.__name__  # GraphModule(class_name=type(float model).__name__)
    return f"{cls.__module__}.{cls.__qualname__}"


def structure(model: nn.Module) -> list[tuple[str, tuple]]:
    """``[(name, shape)]`` of the model's parameters outside its quantizers, sorted by name.

    The weights a model is made of, not how it is quantized: two models with the same list take
    each other's weights; an LSQ scale (a quantizer's Parameter) is left out.
    """
    from .quantizer import FakeQuantizer

    quantizers = tuple(f"{n}." for n, m in model.named_modules() if n and isinstance(m, FakeQuantizer))
    return sorted((n, tuple(p.shape)) for n, p in model.named_parameters()
                  if not quantizers or not n.startswith(quantizers))


def fingerprint(entries) -> str:
    """First 16 hex digits of SHA-256 over ``structure``'s list: equal lists, equal fingerprints."""
    text = "\n".join(f"{name}:{','.join(map(str, shape))}" for name, shape in entries)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_checkpoint(model: nn.Module, path: Union[str, os.PathLike], **extra) -> None:
    """Write ``{"state_dict", "recipe", "hardware", "dal_version", "model_class", "structure",
    "fingerprint", **extra}`` with ``torch.save``.

    The recipe and the hardware model are stored as plain dicts (``to_dict()``): a custom or
    edited hardware model (its requantizer, say) comes back as it was, not as the bundled model
    of the same name. ``model_class`` is the prepared model's class (``module.QualName``),
    ``structure`` its parameters' names and shapes (quantizers left out) and ``fingerprint`` a
    hash of that list; :func:`load_checkpoint` compares them with the model it builds.
    """
    import dal

    from .prepare.handle import find_prepared

    handle = find_prepared(model)
    recipe, hardware = (handle.recipe, handle.hardware) if handle is not None else (None, None)
    if recipe is None:
        raise ValueError("save_checkpoint: the model was not prepared with dal.prepare_qat (no recipe attached)")
    entries = structure(model)
    torch.save({"state_dict": model.state_dict(), "recipe": recipe.to_dict(),
                "hardware": hardware.to_dict() if hardware is not None else None, "dal_version": dal.__version__,
                "model_class": model_class(model), "structure": [[n, list(s)] for n, s in entries],
                "fingerprint": fingerprint(entries), **extra}, str(path))


def resolve_factory(spec: Union[str, Callable[[], nn.Module]]) -> Callable[[], nn.Module]:
    """``"package.module:function"`` (or a callable) -> a zero-argument model factory."""
    if callable(spec):
        return spec
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"model factory {spec!r} must look like 'package.module:function' "
                         "(for example dal_examples.zoo:MnistCNN or torchvision.models:resnet18)")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model factory {spec!r} cannot be loaded: {err}") from err
    return obj


def load_checkpoint(path: Union[str, os.PathLike], model_factory, example_inputs=None) -> nn.Module:
    """Build the float model, ``prepare_qat`` it with the stored recipe and hardware, load the
    weights, quantizer parameters and states; returns the QAT model in eval mode.

    ``example_inputs`` are passed to ``prepare_qat``. Output quantizers the checkpoint holds
    (``<layer>.output_quant.*``: added by the example forward at training time, on the layers
    producing the model's outputs) that this prepare did not add are recreated from the stored
    recipe, so loading needs no ``example_inputs`` for them; anything else the example forward
    decided (functional ops found by call site in a forward torch.fx cannot trace) needs them,
    and the ``ValueError`` says so. A model whose parameters differ from the checkpoint's
    raises ``ValueError`` naming the class that wrote it and the first parameters that differ.
    """
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
    built = model_class(model)
    model = dal.prepare_qat(model, recipe=ckpt["recipe"], hardware=ckpt.get("hardware"), example_inputs=example_inputs)
    _check_structure(path, ckpt, model, built, example_inputs)
    state = ckpt["state_dict"]
    _recreate_output_quantizers(model, state)  # also when this prepare adds none (example_inputs=None, a recipe default)
    result = model.load_state_dict(state, strict=False)  # a mismatch is raised below, naming its cause
    unexpected, absent = sorted(result.unexpected_keys), sorted(result.missing_keys)
    if unexpected or absent:
        hint = ("pass example_inputs=(x,) (inputs of the shape the model was prepared with) to load_checkpoint: "
                "prepare_qat's example forward decides these" if example_inputs is None else
                "prepare the model as it was prepared for training (same recipe, hardware and example_inputs)")
        raise ValueError(f"{path}: the prepared model does not have the checkpoint's quantizers: "
                         f"{len(unexpected)} key(s) only in the checkpoint {unexpected[:4]}, "
                         f"{len(absent)} only in the model {absent[:4]}; {hint}")
    return model.eval()


def _check_structure(path, ckpt: dict, model: nn.Module, built: str, example_inputs) -> None:
    """Raise ``ValueError`` when ``model``'s parameters are not the checkpoint's (files written
    before dal recorded them are not checked)."""
    stored = ckpt.get("structure")
    if stored is None:
        return
    want = {n: tuple(s) for n, s in stored}
    have = dict(structure(model))
    if want == have:
        return
    diffs = [f"{n}: checkpoint {want[n] if n in want else 'absent'}, model {have[n] if n in have else 'absent'}"
             for n in sorted(set(want) | set(have)) if want.get(n) != have.get(n)]
    more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
    hint = (" If it is the same model, pass the example_inputs it was prepared with."
            if example_inputs is None else "")
    raise ValueError(f"{path} was written by a prepared {ckpt.get('model_class', '?')} (fingerprint "
                     f"{ckpt.get('fingerprint', '?')}); the model built, a {built} (fingerprint "
                     f"{fingerprint(sorted(have.items()))}), has other parameters: {'; '.join(diffs[:4])}{more}. "
                     f"Pass the model_factory that built the checkpoint's model.{hint}")


def _recreate_output_quantizers(model: nn.Module, state: dict) -> None:
    """Give each layer of ``model`` that has no output quantizer while ``state`` holds
    ``<layer>.output_quant.*`` keys its output quantizer, built from the prepared recipe's spec for that layer as
    ``prepare_qat``'s example forward builds it (the layers producing the model's outputs)."""
    from .hardware.op_classes import OP_CLASSES
    from .nn.registry import float_type_name, op_class_of
    from .nn.spec import make_quantizer
    from .prepare.handle import prepared

    recipe = prepared(model).recipe
    owners = {key.rpartition("output_quant.")[0][:-1] for key in state  # "head." -> "head"
              if key.startswith("output_quant.") or ".output_quant." in key}
    for owner in sorted(owners):
        try:
            mod = model.get_submodule(owner)
        except AttributeError:
            continue
        if not hasattr(mod, "output_quant") or getattr(mod, "output_quant") is not None:
            continue
        op_class = op_class_of(mod)
        spec = recipe.resolve(owner, float_type_name(mod), op_class if op_class in OP_CLASSES else None)
        if spec is None or spec.input is None or spec.fallback_fp16:
            continue
        mod.output_quant = make_quantizer(spec.input, None, f"{owner}.output_quant" if owner else "output_quant")
