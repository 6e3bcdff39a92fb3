"""``dal.prepared(model)``: the one way to reach what ``prepare_qat`` decided for a model.

``prepare_qat`` attaches a single :class:`Prepared` object (recipe, hardware model, plan and
report) to the model it returns; calibration, export, checkpoints and the analyses read it
through :func:`prepared` / :func:`find_prepared`, which see through the wrappers a training
script puts around a model: ``DistributedDataParallel`` and ``nn.DataParallel`` (``.module``),
``torch.compile``'s ``OptimizedModule`` (``._orig_mod``), and a container such as a
``LightningModule`` that holds the prepared network as one of its attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

#: the prepared model's instance attribute that holds its :class:`Prepared` (public: dal sets it on
#: the user's model, whose class is not dal's)
ATTR = "dal_prepared"
#: attributes through which wrappers reach the module they wrap (DDP / DataParallel, torch.compile)
_WRAPPED = ("module", "_orig_mod")


@dataclass
class Prepared:
    """What ``prepare_qat`` decided: ``recipe`` (a ``dal.recipe.Recipe``), ``hardware`` (a
    ``HardwareModel`` or None), ``report`` (the ``PrepareReport``, rendered from ``plan`` and
    ``actions``: the steps and the model-wide actions, ``dal.prepare.actions.ModelActions``),
    ``calls`` (the float example forward's record, ``dal.capture.Entry`` per module and function
    call, in order, without call sites; empty without example inputs)."""

    recipe: Any
    hardware: Any
    report: Any
    plan: list = field(default_factory=list, repr=False)
    actions: Any = field(default=None, repr=False)
    calls: tuple = field(default=(), repr=False)


def attach(model: nn.Module, handle: Prepared) -> nn.Module:
    """Attach ``handle`` to ``model`` (one plain attribute: it pickles and deep-copies with it)."""
    object.__setattr__(model, ATTR, handle)  # not nn.Module.__setattr__: a plain attribute, never a submodule
    return model


def find_prepared(model: Any) -> Optional[Prepared]:
    """The :class:`Prepared` of ``model`` or of the prepared network it wraps, else None.

    Order: the object itself; then the module a wrapper holds (``.module``, ``._orig_mod``);
    then, for any other module, its direct children (a LightningModule's ``self.model``) —
    exactly one prepared child is needed, two different ones raise ``ValueError`` naming them.
    """
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        handle = getattr(model, "__dict__", {}).get(ATTR)
        if handle is not None:
            return handle
        inner = next((getattr(model, a) for a in _WRAPPED if isinstance(getattr(model, a, None), nn.Module)), None)
        if inner is None:
            break
        model = inner
    if not isinstance(model, nn.Module):
        return None
    found = {}
    for name, child in model.named_children():
        handle = find_prepared(child) if id(child) not in seen else None
        if handle is not None:
            found.setdefault(id(handle), (name, handle))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found.values())
        raise ValueError(f"{type(model).__name__} holds several prepared networks ({names}): pass the one you "
                         "mean, e.g. dal.prepared(module.<attribute>)")
    return next(iter(found.values()))[1] if found else None


def prepared(model: Any) -> Prepared:
    """The :class:`Prepared` of ``model`` (see :func:`find_prepared` for the wrappers it sees
    through); a model ``prepare_qat`` never saw raises ``ValueError`` saying what to do.

    >>> model = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000")   # doctest: +SKIP
    >>> dal.prepared(torch.nn.parallel.DistributedDataParallel(model)).recipe.name   # doctest: +SKIP
    'int8_balanced'
    """
    handle = find_prepared(model)
    if handle is None:
        raise ValueError(f"{type(model).__name__} was never prepared by dal: call "
                         "dal.prepare_qat(model, recipe=..., hardware=...) first (or pass the prepared module "
                         "itself, not a copy made before preparing)")
    return handle
