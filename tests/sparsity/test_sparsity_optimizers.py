"""Pruned weights stay exactly zero after every optimizer step, for 100 steps, with mask
changes midway; pruned gradients never reach the optimizer."""
import pytest
import torch
from torch import nn

import dal.sparsity as sp
from sparsity_helpers import tiny_batch, tiny_model

OPTIMIZERS = {
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                              weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw_wd": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
SCHEDULES = {
    "one_shot": lambda: sp.OneShot(),
    "gradual": lambda: sp.Gradual(steps=60, every=7, begin=5),
    "recompute_freeze": lambda: sp.RecomputeThenFreeze(every=10, freeze_at=70),
}


def sparse_modules(model):
    return [m for m in model.modules() if getattr(m, "weight_mask", None) is not None]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("sched_name", list(SCHEDULES))
def test_pruned_weights_exactly_zero_for_100_steps(opt_name, sched_name):
    model = sp.prepare_sparse(tiny_model(), schedule=SCHEDULES[sched_name]())
    ctl = sp.controller_of(model)
    opt = OPTIMIZERS[opt_name](model.parameters())
    mods = sparse_modules(model)
    assert len(mods) == 4
    changes = 0
    for step in range(100):
        x, y = tiny_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for mod in mods:   # gradients of pruned weights are masked before the optimizer
            assert not mod.weight.grad[~mod.weight_mask].any()
        opt.step()
        for mod in mods:   # the stored parameter, read right after optimizer.step()
            assert (mod.weight[~mod.weight_mask] == 0).all()
        before = [mod.weight_mask.clone() for mod in mods]
        ctl.step()
        changes += sum(not torch.equal(b, mod.weight_mask) for b, mod in zip(before, mods))
        for mod in mods:
            assert (mod.weight[~mod.weight_mask] == 0).all()
    for mod in mods:
        assert (sp.report(model).all_valid)
        g = mod.weight_mask.movedim(1, -1).reshape(-1, 4).sum(1)
        assert (g == 2).all()
    if sched_name == "one_shot":
        assert changes == 0
    else:
        assert changes > 0, "the schedule should have changed masks midway"


def test_auto_step_with_attached_optimizer():
    model = sp.prepare_sparse(tiny_model(), schedule=sp.Gradual(steps=10))
    ctl = sp.controller_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctl.attach(opt, auto_step=True)
    for step in range(12):
        x, y = tiny_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert ctl.current_step == 12
    assert sp.report(model).all_valid


def test_optimizer_state_cleared_where_mask_changes():
    model = sp.prepare_sparse(tiny_model(), schedule=sp.Gradual(steps=4))
    ctl = sp.controller_of(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(6):
        x, y = tiny_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ctl.step()
    for mod in sparse_modules(model):
        st = opt.state[mod.weight]
        assert not st["exp_avg"][~mod.weight_mask].any()
        assert not st["exp_avg_sq"][~mod.weight_mask].any()


class JitterOptimizer(torch.optim.Optimizer):
    """A hostile custom optimizer: moves every weight, through .data (no version bump)."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(0.01)


def test_custom_optimizer_cannot_leave_nonzero_behind():
    model = sp.prepare_sparse(tiny_model())
    opt = JitterOptimizer(model.parameters())
    for _ in range(3):
        opt.step()
        for mod in sparse_modules(model):
            assert (mod.weight[~mod.weight_mask] == 0).all()
            assert (mod.weight[mod.weight_mask] != 0).all()


def test_pruned_values_get_no_gradient_between_recomputes():
    model = sp.prepare_sparse(tiny_model(), schedule=sp.RecomputeThenFreeze(every=10,
                                                                           freeze_at=100))
    ctl = sp.controller_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    snap = None
    for step in range(1, 21):
        x, y = tiny_batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ctl.step()
        if step == 10:
            snap = [(m.weight_mask.clone(), m.weight_pruned_values.clone())
                    for m in sparse_modules(model)]
    returned = 0
    for (mask10, vals10), mod in zip(snap, sparse_modules(model)):
        both = ~mask10 & ~mod.weight_mask          # pruned at step 10 and still pruned
        assert torch.equal(mod.weight_pruned_values[both], vals10[both])
        back = ~mask10 & mod.weight_mask           # returned at step 20 with its frozen value
        assert torch.equal(mod.weight.detach()[back], vals10[back])
        returned += int(back.sum())
    assert returned > 0
