"""MNIST 2:4 + INT8 QAT with the real quantizers on: after every optimizer step every mask is
2:4, every pruned weight is exactly 0, and the fake-quantized weights are 2:4."""
import pytest
import torch
import torch.nn.functional as F

import dal
import dal.sparsity as sp
from dal.hardware import load_hardware
from dal_examples.zoo import MnistCNN
from sparsity_qat_helpers import engine_weight, max_nonzeros_per_group, mnist_batches

STEPS = 30


def _check(model, ctl):
    for name in ctl.layers:
        mod = model.get_submodule(name)
        mask = mod.weight_mask
        groups = mask.movedim(1, -1).reshape(-1, 4).sum(dim=1)
        assert bool((groups == 2).all()), f"{name}: mask is not exactly 2 of 4"
        assert not mod.weight.detach()[~mask].any(), f"{name}: a pruned weight is not 0"
        assert max_nonzeros_per_group(engine_weight(mod), 1) <= 2, f"{name}: quantized weight not 2:4"


@pytest.mark.parametrize("schedule", [None, sp.RecomputeThenFreeze(every=10, freeze_at=25)],
                         ids=["one_shot_from_recipe", "recompute_then_freeze"])
def test_masks_and_zeros_hold_through_mnist_qat(schedule):
    torch.manual_seed(0)
    data = mnist_batches(STEPS * 64, 64)
    model = MnistCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in mnist_batches(40 * 64, 64, offset=STEPS * 64):   # QAT starts from a trained float model
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if schedule is not None:  # a schedule of the user's: prepare_sparse first, prepare_qat keeps it
        sp.prepare_sparse(model, schedule=schedule, hardware=load_hardware("a2000"))
    model = dal.prepare_qat(model, recipe="int8_sparse24", hardware="a2000",
                            example_inputs=(data[0][0][:1],))
    dal.calibrate(model, [x for x, _ in data[:4]], progress=False)
    ctl = sp.controller_of(model)
    assert len(ctl.layers) == 4
    quantizers = [m for m in model.modules() if isinstance(m, dal.FakeQuantizer)]
    assert quantizers and all(q.state == "quantize" for q in quantizers)  # real quantizers on
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    masks_seen, losses = set(), []
    model.train()
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ctl.step()
        losses.append(float(loss.detach()))
        _check(model, ctl)
        masks_seen.add(hash(model.head.weight_mask.numpy().tobytes()))
    assert ctl.current_step == STEPS
    assert sum(losses[-5:]) / 5 < 0.8, losses                  # it trained, quantized and 2:4
    if schedule is not None:
        assert len(masks_seen) > 1                             # recomputed masks stayed valid too
    model.eval()
    _check(model, ctl)
