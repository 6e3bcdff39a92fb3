"""prepare_sparse: choose the layers, optionally permute channels, attach N:M masks."""
from __future__ import annotations

from typing import Callable, Iterable, Union

from torch import nn

from .controller import CONTROLLER_ATTR, SparsityController, find_controller
from .layout import sparse_types, op_class, reduction_axis, reduction_group_length
from .pattern import parse_pattern
from .permute import permute_sequential_pairs
from .schedule import SparsitySchedule, resolve_schedule

__all__ = ["prepare_sparse", "dense_reason"]

LayerFilter = Union[None, Callable[[str, nn.Module], bool], Iterable[str]]


def dense_reason(module: nn.Module, m: int = 4, hardware=None,
                 pattern: "str | None" = None) -> "str | None":
    """Why ``module`` (a Linear / Conv / ConvTranspose) must stay dense, or None if an N:M
    mask with group size ``m`` fits it. Checked: a weight of 2+ dims, a reduction length
    (input channels per conv group) that is a multiple of ``m`` (depthwise convolutions,
    one input channel per group, are named as such), and the hardware:
    ``hardware.supports_sparsity(op_class)`` for 2:4 (or ``pattern`` None),
    ``hardware.supports_sparsity(op_class, pattern)`` for any other pattern, so a one-argument
    ``supports_sparsity`` is enough for hardware that only knows 2:4."""
    w = getattr(module, "weight", None)
    if isinstance(w, nn.parameter.UninitializedParameter):
        return "weight not initialized yet (lazy module): run one forward first"
    if w is None or w.dim() < 2:
        return "no 2-D+ weight"
    length = reduction_group_length(module)
    if length == 1 and getattr(module, "groups", 1) > 1:
        return "depthwise convolution (1 input channel per group): nothing to reduce over"
    if length % m:
        what = ("in_features" if isinstance(module, nn.Linear) else
                "input channels" if getattr(module, "groups", 1) == 1 else "input channels per group")
        return f"{what} = {length} is not a multiple of {m}"
    if hardware is not None:
        cls = op_class(module)
        ok = (hardware.supports_sparsity(cls) if pattern in (None, "2:4")
              else hardware.supports_sparsity(cls, pattern))
        if not ok:
            hw = getattr(hardware, "name", type(hardware).__name__)
            what = "sparse" if pattern in (None, "2:4") else f"{pattern} sparse"
            return f"hardware {hw} cannot run {cls} with {what} weights"
    return None


def _selected(layers: LayerFilter, name: str, module: nn.Module) -> bool:
    if layers is None:
        return True
    if callable(layers):
        return bool(layers(name, module))
    return name in layers


def prepare_sparse(model: nn.Module, pattern: str = "2:4",
                   schedule: "SparsitySchedule | str | None" = None,
                   layers: LayerFilter = None, permute: bool = False,
                   hardware=None) -> nn.Module:
    """Attach N:M masks to every eligible Linear / Conv / ConvTranspose of ``model`` (in
    place) and return ``model``.

    - ``pattern``: ``"N:M"`` (``"2:4"``, ``"1:4"``, ``"4:8"``, ...); anything else is a
      ``ValueError``. Groups run along the reduction (input-channel) axis, see ``layout.py``.
    - ``schedule``: :class:`OneShot` (default, also ``"one_shot"``), :class:`Gradual`,
      :class:`RecomputeThenFreeze`. Step-0 masks are computed here.
    - ``layers``: None (all), a callable ``(name, module) -> bool``, or a collection of
      module names. Layers filtered out are listed as skipped.
    - ``permute``: run the channel-permutation search first (float models; scope in
      ``permute.py``), so masks keep more magnitude; the function is unchanged.
    - ``hardware``: None (everything allowed) or an object with
      ``supports_sparsity(op_class[, pattern]) -> bool`` (a ``dal.hardware.HardwareModel``),
      asked with ``"linear"``, ``"conv"`` or ``"conv_transpose"`` (and the pattern string
      when it is not 2:4).

    Modules are matched by ``isinstance`` of the torch classes, so dal's QAT modules
    qualify. Layers that cannot be sparse (reduction length not a multiple of M, depthwise,
    refused by the hardware) stay dense and are listed with the reason in
    ``dal.sparsity.report(model)``; that is not an error.

    Afterwards: call ``dal.sparsity.controller_of(model).step()`` once per training step,
    after ``optimizer.step()`` (or ``controller.attach(optimizer, auto_step=True)``).
    Pruned weights are kept exactly zero after every optimizer step (see ``controller.py``).

    >>> model = prepare_sparse(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6)))
    >>> print(report(model))  # doctest: +SKIP
    """
    pat = parse_pattern(pattern)
    sched = resolve_schedule(schedule)
    if find_controller(model) is not None:
        raise ValueError(f"{type(model).__name__} is already sparse; call "
                         "dal.sparsity.controller_of(model).remove() before preparing again")
    chosen: "dict[str, int]" = {}
    skipped: "dict[str, str]" = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, sparse_types()):
            continue
        if getattr(mod, "weight_mask", None) is not None:
            raise ValueError(f"module {name!r} already has a weight_mask buffer; remove it "
                             "before calling prepare_sparse")
        if not _selected(layers, name, mod):
            skipped[name] = "excluded by the layers filter"
            continue
        reason = dense_reason(mod, pat.m, hardware, str(pat))
        if reason is not None:
            skipped[name] = reason
            continue
        chosen[name] = reduction_axis(mod)
    permuted = permute_sequential_pairs(model, set(chosen), pat.n, pat.m) if permute else {}
    ctl = SparsityController(model, pat, sched, chosen, skipped, permuted)
    ctl.attach()
    object.__setattr__(model, CONTROLLER_ATTR, ctl)  # a plain attribute: not a submodule
    return model
