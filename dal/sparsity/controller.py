"""SparsityController: owns the masks of a model, advances the schedule, keeps zeros zero.

Module protocol (what dal's QAT modules read)
---------------------------------------------
Every sparse module carries these buffers, all in its ``state_dict``:

- ``weight_mask``: bool, shape of ``weight``; True = kept. Always updated *in place*
  (``copy_``), so anyone holding the tensor sees the current mask. QAT modules compute
  ``w = self.weight * self.weight_mask`` before their weight fake-quantizer.
- ``weight_sparsity_stats``: float64 ``[step, dense_l1, kept_l1]``: the schedule step, and
  ``sum|w|`` of the weights the mask was last computed from and of the kept ones.
- ``weight_pruned_values`` (only for schedules with ``restore_pruned``): the values the mask
  removed, frozen, ready to compete again at the next recompute.

The schedule object itself is configuration (rebuilt by calling ``prepare_sparse`` with the
same arguments); everything that changes during training is in those buffers, so
``prepare_sparse(...)`` then ``load_state_dict(ckpt)`` resumes exactly.

How pruned weights stay exactly zero under any optimizer
--------------------------------------------------------
1. Whenever a mask is computed or changes, the stored weight is zeroed where the mask is
   False, and the optimizer state tensors shaped like the weight (momentum, Adam moments)
   of the optimizers known to the controller are zeroed where the mask changed.
2. Pruned weights get no gradient, so no momentum builds up and no gradient leaks into
   later mask decisions: a tensor hook on ``weight`` multiplies its gradient by the mask.
   dal's QAT modules (they have ``quantized_weight``) get no hook: their forward multiplies
   the mask into the weight, so autograd already masks the gradient, and a second multiply
   of the step's largest tensors would cost ~5% of a ResNet-18 QAT step for nothing.
3. After every ``optimizer.step()`` of an optimizer that holds a sparse weight, the pruned
   entries are set to 0 again (post-step hook). ``prepare_sparse`` registers this hook for
   all optimizers (``torch.optim.optimizer.register_optimizer_step_post_hook``, filtered to
   optimizers that own our weights, removed by :meth:`SparsityController.remove`);
   :meth:`attach` scopes it to one optimizer instead. Weight decay, stale momentum or a
   custom optimizer cannot leave a non-zero behind.
4. A forward pre-hook re-applies the mask when the weight changed since it was last
   enforced (tracked with the tensor's version counter), e.g. after ``load_state_dict`` of
   dense weights or a manual edit, so the forward of a plain ``nn.Linear`` / ``nn.Conv2d``
   always uses the masked weight. Nothing is written when the weight is unchanged, so
   several forwards before one backward are safe. Writes through ``weight.data`` do not bump
   the version counter and are not seen by this hook (step 3 still catches them after the
   next optimizer step; ``controller.enforce()`` does it at once).

The schedule advances only when the user calls :meth:`SparsityController.step` (once per
training step, after ``optimizer.step()``), or automatically after each step of one
optimizer with ``controller.attach(optimizer, auto_step=True)``.

A new root over the same modules
--------------------------------
The controller finds its modules by name in its root model. When a model is rebuilt around
the same sparse modules (``dal.prepare_qat`` returns a ``torch.fx.GraphModule`` when the
root's forward has functional ops, and its QAT modules take over the float modules'
Parameter and buffer objects), :func:`controller_of` on the new root finds the controller
through the identity of the ``weight_mask`` tensors and moves it there. A *copy* of a model
(``copy.deepcopy``) has new mask tensors and gets no controller: prepare the copy again.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..nn.tree import has_instance_attribute, own_slots
from .mask import nm_mask, nm_mask_partial
from .pattern import NMPattern
from .schedule import SparsitySchedule

__all__ = ["SparsityController", "controller_of", "find_controller", "CONTROLLER_ATTR"]

#: attribute of the root model that holds its controller
CONTROLLER_ATTR = "dal_sparsity"
#: module -> its weight's version (``Tensor._version``) when ``_enforce_module`` last zeroed it;
#: entries vanish with the module (nn.Module hashes and compares by identity)
_WEIGHT_VERSIONS: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
#: id(weight_mask tensor) -> its controller; entries vanish with the controller. A lookup is
#: confirmed by tensor identity (ids of dead tensors are reused).
_BY_MASK: "weakref.WeakValueDictionary[int, SparsityController]" = weakref.WeakValueDictionary()


def _enforce_module(module: nn.Module, exact: bool = False) -> None:
    """Zero the pruned entries of ``module.weight`` and record the weight's version.

    Runs after every optimizer step, so it must be cheap: ``weight.mul_(mask)`` (faster than
    ``masked_fill_`` on CPU, bench/sparsity.py) allocates nothing. Pruned
    entries become +-0.0, equal to 0 (code 0 for any zero point 0); only a value that is
    already NaN / inf (a diverged step) would survive it. ``exact=True`` (mask recomputes,
    rare) writes +0.0 with ``masked_fill_``."""
    w, mask = module.weight, module.weight_mask
    with torch.no_grad():
        if exact:
            w.masked_fill_(mask.logical_not(), 0)
        else:
            w.mul_(mask)
    _WEIGHT_VERSIONS[module] = w._version


def _forward_pre_hook(module: nn.Module, args) -> None:
    if getattr(module, "weight_mask", None) is None:
        return
    if _WEIGHT_VERSIONS.get(module) != module.weight._version:
        _enforce_module(module)


def _grad_hook(mask: Tensor):
    def hook(grad: Tensor) -> Tensor:
        return grad * mask
    return hook


class SparsityController:
    """Masks, schedule and enforcement for the sparse layers of one model.

    Built by :func:`dal.sparsity.prepare_sparse` (which computes the step-0 masks); reach it
    with :func:`controller_of` (``model.dal_sparsity``).

    Attributes (plain data): ``pattern`` (:class:`NMPattern`), ``schedule``, ``layers``
    (``{name: reduction axis}`` of the sparse layers), ``skipped`` (``{name: reason}``),
    ``permuted`` (``{name: note}`` from the channel-permutation search).
    """

    def __init__(self, model: nn.Module, pattern: NMPattern, schedule: SparsitySchedule,
                 layers: "dict[str, int]", skipped: "dict[str, str] | None" = None,
                 permuted: "dict[str, str] | None" = None) -> None:
        self._root = weakref.ref(model)
        self.pattern = pattern
        self.schedule = schedule
        self.layers = dict(layers)
        self.skipped = dict(skipped or {})
        self.permuted = dict(permuted or {})
        self._handles: list = []
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._owned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._auto_step: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._step_no_layers = 0
        self._masks: "dict[str, Tensor]" = {}
        for name in self.layers:
            self._install(name)
        self.update_masks(0)

    # ------------------------------------------------------------------ plumbing
    def module(self, name: str) -> nn.Module:
        """The sparse module called ``name``, looked up in the model now (so a module
        swapped in place by ``prepare_qat`` is found)."""
        root = self._root()
        if root is None:
            raise RuntimeError("the model of this SparsityController no longer exists")
        return root.get_submodule(name)

    def _install(self, name: str) -> None:
        mod = self.module(name)
        w = mod.weight
        mod.register_buffer("weight_mask", torch.ones_like(w, dtype=torch.bool))
        self._masks[name] = mod.weight_mask
        _BY_MASK[id(mod.weight_mask)] = self
        mod.register_buffer("weight_sparsity_stats",
                            torch.zeros(3, dtype=torch.float64, device=w.device))
        if self.schedule.restore_pruned:
            mod.register_buffer("weight_pruned_values", torch.zeros_like(w.detach()))
        if not callable(getattr(mod, "quantized_weight", None)):  # see point 2 above
            self._handles.append(w.register_hook(_grad_hook(mod.weight_mask)))
        self._handles.append(mod.register_forward_pre_hook(_forward_pre_hook))

    @property
    def current_step(self) -> int:
        """Schedule step: 0 right after ``prepare_sparse``, +1 per :meth:`step`."""
        if not self.layers:
            return self._step_no_layers
        return int(self.module(next(iter(self.layers))).weight_sparsity_stats[0])

    # ------------------------------------------------------------------ schedule
    def step(self) -> None:
        """Advance the schedule by one step; recompute masks if the schedule says so; zero the
        pruned weights. Call once per training step after ``optimizer.step()``."""
        t = self.current_step + 1
        self._step_no_layers = t
        for name in self.layers:
            self.module(name).weight_sparsity_stats[0] = t
        if self.schedule.updates_at(t):
            self.update_masks(t)
        self.enforce(force=False)

    @torch.no_grad()
    def update_masks(self, step: int) -> None:
        """Recompute every mask for ``step`` (normally called by :meth:`step`)."""
        frac = self.schedule.fraction(step)
        n, m = self.pattern.n, self.pattern.m
        for name, axis in self.layers.items():
            mod = self.module(name)
            w, old = mod.weight, mod.weight_mask
            restore = self.schedule.restore_pruned
            dense = w + mod.weight_pruned_values if restore else w.detach()
            # sticky: without restore, pruned entries (zero, no gradient) stay pruned
            prior = None if restore or step == 0 else old
            if frac >= 1.0:
                new = nm_mask(dense, n, m, axis, prior=prior)
            else:
                new = nm_mask_partial(dense, frac, n, m, axis, prior=prior)
            stats = mod.weight_sparsity_stats
            stats[0] = step
            stats[1] = dense.abs().sum(dtype=torch.float64)
            stats[2] = dense.masked_fill(~new, 0).abs().sum(dtype=torch.float64)
            changed = new != old
            if restore:
                mod.weight_pruned_values.copy_(dense.masked_fill(new, 0))
                w.copy_(dense.masked_fill(~new, 0))
            old.copy_(new)
            _enforce_module(mod, exact=True)
            if bool(changed.any()):
                self._reset_optimizer_state(w, changed)

    def _reset_optimizer_state(self, param: Tensor, where: Tensor) -> None:
        for opt in list(self._optimizers):
            state = opt.state.get(param)
            if not state:
                continue
            for v in state.values():
                if isinstance(v, Tensor) and v.shape == param.shape:
                    v.masked_fill_(where, 0)

    # ------------------------------------------------------------------ enforcement
    def enforce(self, names: "Iterable[str] | None" = None, force: bool = True) -> None:
        """Set every pruned weight to exactly 0 now. ``force=False`` skips weights whose
        version counter is unchanged since they were last enforced (writes through
        ``.data`` do not bump it, hence the default)."""
        for name in (self.layers if names is None else names):
            mod = self.module(name)
            if force or _WEIGHT_VERSIONS.get(mod) != mod.weight._version:
                _enforce_module(mod)

    def _after_optimizer_step(self, opt: torch.optim.Optimizer, may_step: bool) -> None:
        n_params = sum(len(g["params"]) for g in opt.param_groups)
        cached = self._owned.get(opt)
        if cached is None or cached[0] != n_params:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            mine = [name for name in self.layers if id(self.module(name).weight) in ids]
            cached = (n_params, mine)
            self._owned[opt] = cached
        if not cached[1]:
            return
        self._optimizers.add(opt)
        self.enforce(cached[1])
        if may_step and opt in self._auto_step:
            self.step()

    def attach(self, optimizer: "torch.optim.Optimizer | None" = None, *,
               auto_step: bool = False) -> None:
        """Enforce zeros after each step of ``optimizer`` (``None``: of every optimizer that
        holds one of our weights; ``prepare_sparse`` already did that). ``auto_step=True``
        (needs an optimizer) also advances the schedule after each of its steps, so the
        training loop need not call :meth:`step`. The optimizer's state is cleaned where
        masks change."""
        ref = weakref.ref(self)

        def hook(opt, args, kwargs):
            ctl = ref()
            if ctl is not None:
                ctl._after_optimizer_step(opt, may_step=optimizer is not None)

        if optimizer is None:
            if auto_step:
                raise ValueError("auto_step=True needs the optimizer whose steps count")
            handle = register_optimizer_step_post_hook(hook)
        else:
            self._optimizers.add(optimizer)
            if auto_step:
                self._auto_step.add(optimizer)
            handle = optimizer.register_step_post_hook(hook)
        self._handles.append(handle)
        weakref.finalize(self, handle.remove)

    def remove(self) -> None:
        """Undo ``prepare_sparse``: remove hooks and sparsity buffers. Weights keep their
        zeros (the model stays sparse but nothing keeps it so)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mask in self._masks.values():
            _BY_MASK.pop(id(mask), None)
        self._masks.clear()
        for name in self.layers:
            mod = self.module(name)
            for buf in ("weight_mask", "weight_sparsity_stats", "weight_pruned_values"):
                if buf in own_slots(mod).buffers:
                    delattr(mod, buf)
            _WEIGHT_VERSIONS.pop(mod, None)
        root = self._root()
        if root is not None and _held_controller(root) is self:
            object.__delattr__(root, CONTROLLER_ATTR)

    def __repr__(self) -> str:
        return (f"SparsityController(pattern={self.pattern}, schedule={self.schedule!r}, "
                f"step={self.current_step}, sparse={len(self.layers)}, "
                f"skipped={len(self.skipped)})")


def _held_controller(model: nn.Module):
    """The controller ``model`` holds itself as a plain attribute (not a wrapper's or a class's), or None."""
    return getattr(model, CONTROLLER_ATTR) if has_instance_attribute(model, CONTROLLER_ATTR) else None


def find_controller(model: nn.Module) -> "SparsityController | None":
    """The controller of ``model``, or None. Looks at the root attribute first, then for a
    controller whose masks are all held, under the same names, by ``model``'s modules (a new
    root built over the same modules, e.g. by ``dal.prepare_qat``); such a controller is moved
    to ``model`` (it leaves the old root)."""
    ctl = _held_controller(model)
    if ctl is not None:
        return ctl
    for name, mod in model.named_modules():
        mask = own_slots(mod).buffers.get("weight_mask")
        cand = _BY_MASK.get(id(mask)) if mask is not None else None
        if cand is None or cand._masks.get(name) is not mask:
            continue
        try:
            mine = all(own_slots(model.get_submodule(n)).buffers.get("weight_mask") is m
                       for n, m in cand._masks.items())
        except AttributeError:
            mine = False
        if mine:
            old = cand._root()
            if old is not None and _held_controller(old) is cand:
                object.__delattr__(old, CONTROLLER_ATTR)
            cand._root = weakref.ref(model)
            object.__setattr__(model, CONTROLLER_ATTR, cand)
            return cand
    return None


def controller_of(model: nn.Module) -> SparsityController:
    """The :class:`SparsityController` that ``prepare_sparse`` attached to ``model`` (also
    found from a new root over the same modules: see :func:`find_controller`)."""
    ctl = find_controller(model)
    if ctl is None:
        raise ValueError(f"{type(model).__name__} has no sparsity controller: call "
                         "dal.sparsity.prepare_sparse(model, ...) first")
    return ctl
