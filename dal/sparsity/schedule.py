"""When masks are (re)computed and how many groups are pruned at each step.

A schedule is a frozen, stateless description; the step counter lives in the model (buffer
``weight_sparsity_stats``, see ``controller.py``) so a checkpoint restores it. The controller
asks, at every step ``t`` (``t = 0`` is ``prepare_sparse``; ``controller.step()`` advances
``t`` by one):

- ``updates_at(t)``: recompute the mask at this step?
- ``fraction(t)``: fraction of the groups that must be N:M (1.0 = the whole tensor N:M;
  0.0 = dense). Density is ``1 - fraction * (1 - N/M)``.
- ``restore_pruned``: when True, values pruned earlier are kept aside (buffer
  ``weight_pruned_values``, frozen: they get no gradient) and compete again at the next
  recompute, as NVIDIA ASP's ``allow_recompute_mask``. When False, pruned weights stay
  pruned (zero, no gradient) for good: recomputes only decide about groups still dense.
- ``last_update``: the step after which the mask can never change (None: never frozen).

Gradients of pruned weights are always masked to zero, so they never influence a later
mask: with ``restore_pruned`` a returning weight comes back with its value at pruning time.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SparsitySchedule", "OneShot", "Gradual", "RecomputeThenFreeze", "resolve_schedule"]


class SparsitySchedule:
    """Base class; subclasses are frozen dataclasses (see module docstring for the protocol)."""

    restore_pruned: bool = False

    def updates_at(self, step: int) -> bool:
        raise NotImplementedError

    def fraction(self, step: int) -> float:
        raise NotImplementedError

    @property
    def last_update(self) -> "int | None":
        raise NotImplementedError


@dataclass(frozen=True)
class OneShot(SparsitySchedule):
    """Full N:M mask computed once, at ``prepare_sparse`` (step 0); never changes."""

    def updates_at(self, step: int) -> bool:
        return step == 0

    def fraction(self, step: int) -> float:
        return 1.0

    @property
    def last_update(self) -> int:
        return 0


@dataclass(frozen=True)
class Gradual(SparsitySchedule):
    """Density ramps from 1.0 to N/M over ``steps`` steps starting at ``begin``.

    ``fraction(t) = 1 - (1 - (t - begin) / steps) ** power`` clipped to [0, 1] (``power=1``
    linear, ``power=3`` the cubic ramp of Zhu & Gupta 2017, which prunes early while the
    network can still adapt). The mask is recomputed every ``every`` steps during the ramp
    and at its last step ``begin + steps``, where it is the full N:M mask. Pruned weights stay
    pruned (``restore_pruned`` False), so density never goes up.

    >>> Gradual(steps=100).fraction(50), Gradual(steps=100).fraction(100)
    (0.5, 1.0)
    """

    steps: int
    every: int = 1
    begin: int = 0
    power: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.every < 1 or self.begin < 0 or self.power <= 0:
            raise ValueError(f"Gradual needs steps >= 1, every >= 1, begin >= 0, power > 0; "
                             f"got {self}")

    def fraction(self, step: int) -> float:
        t = (step - self.begin) / self.steps
        if t <= 0:
            return 0.0
        if t >= 1:
            return 1.0
        return 1.0 - (1.0 - t) ** self.power

    def updates_at(self, step: int) -> bool:
        end = self.begin + self.steps
        return step == 0 or step == end or (
            self.begin <= step < end and (step - self.begin) % self.every == 0)

    @property
    def last_update(self) -> int:
        return self.begin + self.steps


@dataclass(frozen=True)
class RecomputeThenFreeze(SparsitySchedule):
    """Full N:M from step 0; the mask is recomputed every ``every`` steps while
    ``step < freeze_at``, from the trained weights plus the values pruned earlier (kept
    aside, ASP-style), then frozen. The last recompute is at the largest multiple of
    ``every`` below ``freeze_at``.

    >>> s = RecomputeThenFreeze(every=10, freeze_at=25)
    >>> [t for t in range(40) if s.updates_at(t)]
    [0, 10, 20]
    """

    every: int
    freeze_at: int
    restore_pruned: bool = True

    def __post_init__(self) -> None:
        if self.every < 1 or self.freeze_at < 1:
            raise ValueError(f"RecomputeThenFreeze needs every >= 1 and freeze_at >= 1; got {self}")

    def updates_at(self, step: int) -> bool:
        return step < self.freeze_at and step % self.every == 0

    def fraction(self, step: int) -> float:
        return 1.0

    @property
    def last_update(self) -> int:
        return ((self.freeze_at - 1) // self.every) * self.every


_BY_NAME = {"one_shot": OneShot, "oneshot": OneShot, "gradual": Gradual,
            "recompute_then_freeze": RecomputeThenFreeze}


def resolve_schedule(schedule: "SparsitySchedule | str | dict | None") -> SparsitySchedule:
    """A schedule object from what a user or a recipe wrote.

    - ``None`` or ``"one_shot"`` -> :class:`OneShot`; a schedule object passes through;
    - a mapping ``{"kind": "gradual", "steps": 2000, "every": 100, "power": 3}`` (also
      ``"one_shot"``, ``"recompute_then_freeze"``): the plain-data form a YAML recipe can
      carry; the other keys are the dataclass fields.

    Raises ``ValueError`` naming the accepted kinds and fields.

    >>> resolve_schedule({"kind": "gradual", "steps": 100})
    Gradual(steps=100, every=1, begin=0, power=1.0)
    """
    if schedule is None:
        return OneShot()
    if isinstance(schedule, SparsitySchedule):
        return schedule
    kinds = ", ".join(repr(k) for k in _BY_NAME if k != "oneshot")
    if isinstance(schedule, str) and schedule.lower() in _BY_NAME:
        cls = _BY_NAME[schedule.lower()]
        try:
            return cls()
        except TypeError:
            raise ValueError(f"sparsity schedule {schedule!r} needs arguments: write it as a "
                             f"mapping with 'kind' and {_fields(cls)}") from None
    if isinstance(schedule, dict):
        args = dict(schedule)
        kind = str(args.pop("kind", "")).lower()
        cls = _BY_NAME.get(kind)
        if cls is None:
            raise ValueError(f"sparsity schedule {schedule!r}: 'kind' must be one of {kinds}")
        unknown = sorted(set(args) - set(_fields(cls)))
        if unknown:
            raise ValueError(f"sparsity schedule {schedule!r}: {cls.__name__} has no field(s) "
                             f"{unknown}; its fields are {_fields(cls)}")
        try:
            return cls(**args)
        except TypeError as err:
            raise ValueError(f"sparsity schedule {schedule!r}: {err}; fields of "
                             f"{cls.__name__}: {_fields(cls)}") from None
    raise ValueError(f"unknown sparsity schedule {schedule!r}: pass 'one_shot', a mapping with "
                     f"'kind' (one of {kinds}) and its fields, or an object such as "
                     "dal.sparsity.Gradual(steps=...) or "
                     "dal.sparsity.RecomputeThenFreeze(every=..., freeze_at=...)")


def _fields(cls) -> "list[str]":
    from dataclasses import fields

    return [f.name for f in fields(cls) if f.init]
