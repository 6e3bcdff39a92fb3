"""Schedules driven through the controller with real training steps."""
import pytest
import torch
from torch import nn

import dal.sparsity as sp
from sparsity_helpers import tiny_batch, tiny_model


def train(model, steps, lr=0.05, per_step=None):
    ctl = sp.controller_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = tiny_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ctl.step()
        if per_step:
            per_step(step + 1)


def masks(model):
    return {n: m.weight_mask.clone() for n, m in model.named_modules()
            if getattr(m, "weight_mask", None) is not None}


def test_gradual_is_monotone_and_reaches_2to4():
    model = sp.prepare_sparse(tiny_model(), schedule=sp.Gradual(steps=30, every=4, begin=3,
                                                                power=3.0))
    dens, prev = [], masks(model)
    assert all(m.all() for m in prev.values())          # starts dense

    def check(step):
        cur = masks(model)
        for name in cur:
            assert not (cur[name] & ~prev[name]).any(), "a pruned weight came back"
        prev.update(cur)
        dens.append(sum(float(m.float().mean()) for m in cur.values()))

    train(model, 40, per_step=check)
    assert dens == sorted(dens, reverse=True) and len(set(dens)) > 3
    for name, mod in model.named_modules():
        if getattr(mod, "weight_mask", None) is not None:
            g = mod.weight_mask.movedim(1, -1).reshape(-1, 4).sum(1)
            assert (g == 2).all(), name
            assert (mod.weight.detach().movedim(1, -1).reshape(-1, 4) != 0).sum(1).le(2).all()


def test_recompute_then_freeze_changes_then_stops():
    sched = sp.RecomputeThenFreeze(every=5, freeze_at=30)
    model = sp.prepare_sparse(tiny_model(), schedule=sched)
    history = []
    train(model, 60, lr=0.3, per_step=lambda s: history.append((s, masks(model))))
    changed_at = [s for (s, a), (_, b) in zip(history, history[1:])
                  if any(not torch.equal(a[k], b[k]) for k in a)]
    assert changed_at, "recompute never changed a mask"
    assert max(changed_at) < sched.last_update <= 25
    frozen = history[sched.last_update - 1][1]
    for s, mk in history[sched.last_update - 1:]:
        assert all(torch.equal(mk[k], frozen[k]) for k in mk), s
    # pruned values are kept aside and the live weight holds the kept ones only
    for mod in model.modules():
        if getattr(mod, "weight_mask", None) is not None:
            assert not mod.weight_pruned_values[mod.weight_mask].any()
            assert not mod.weight.detach()[~mod.weight_mask].any()


def test_one_shot_never_changes():
    model = sp.prepare_sparse(tiny_model())
    first = masks(model)
    train(model, 20)
    assert all(torch.equal(first[k], v) for k, v in masks(model).items())


def test_schedule_arithmetic_and_validation():
    g = sp.Gradual(steps=10, begin=2, every=3)
    assert [t for t in range(20) if g.updates_at(t)] == [0, 2, 5, 8, 11, 12]
    assert g.fraction(2) == 0.0 and g.fraction(7) == 0.5 and g.fraction(12) == 1.0
    assert sp.OneShot().last_update == 0
    with pytest.raises(ValueError):
        sp.Gradual(steps=0)
    with pytest.raises(ValueError):
        sp.RecomputeThenFreeze(every=0, freeze_at=3)
    with pytest.raises(ValueError, match="unknown sparsity schedule"):
        sp.prepare_sparse(tiny_model(), schedule="sometimes")
