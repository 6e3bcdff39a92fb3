"""Scale-only QAT as a recipe key (``train: scales_only``): prepare_qat freezes the weights, an
unchanged training loop over model.parameters() learns only the scales; bad values are named."""
import pytest
import torch

import dal
from dal.recipe import RecipeError, load_recipe
from dal_examples.zoo import MnistCNN

X = torch.zeros(2, 1, 28, 28)


def test_bundled_scale_only_recipe_loads_and_round_trips():
    rec = load_recipe("w4a8_lsq_scales_only")
    assert rec.train == "scales_only" and load_recipe("w4a8_lsq").train == "all"
    assert load_recipe(rec.to_dict()) == rec
    assert "train" not in load_recipe("w4a8_lsq").to_dict()


def test_prepare_freezes_weights_and_a_plain_loop_trains_only_scales():
    from ptq_helpers import mnist_batches

    train, calib, _ = mnist_batches(n_train=128, calib=64, test=256)
    q = dal.prepare_qat(MnistCNN(), recipe="w4a8_lsq_scales_only", hardware="a2000", example_inputs=(X,))
    dal.calibrate(q, calib, progress=False)
    trainable = {n for n, p in q.named_parameters() if p.requires_grad}
    assert trainable and all("_quant." in n for n in trainable), sorted(trainable)
    assert any(n.endswith("weight_quant.scale") or n.endswith("log2_scale") for n in trainable)
    before = {n: p.detach().clone() for n, p in q.named_parameters()}
    bn_mean = {n: b.clone() for n, b in q.named_buffers() if n.endswith("running_mean")}
    opt = torch.optim.SGD(q.parameters(), lr=1e-2)  # the user's loop, unchanged: every parameter
    q.train()
    for x, y in train[:2]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(q(x), y).backward()
        opt.step()
    after = dict(q.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in before.items() if n not in trainable)  # weights, biases
    assert any(not torch.equal(after[n], before[n]) for n in trainable)  # scales learned
    assert all(torch.equal(b, bn_mean[n]) for n, b in q.named_buffers() if n in bn_mean)  # BN frozen
    # The same recipe without the key trains the weights.
    q2 = dal.prepare_qat(MnistCNN(), recipe="w4a8_lsq", hardware="a2000", example_inputs=(X,))
    assert all(p.requires_grad for n, p in q2.named_parameters() if n.endswith("weight"))


def _recipe(train, learnable=True):
    return {"name": "t", "train": train, "rules": [
        {"type": "conv", "weight": {"format": "int8", "learnable": learnable}}]}


def test_unknown_train_mode_is_named():
    with pytest.raises(RecipeError, match=r"train.*'everything' is not allowed"):
        load_recipe(_recipe("everything"))


def test_scale_only_without_a_learnable_spec_is_refused():
    with pytest.raises(RecipeError, match=r"train.*learnable: true"):
        load_recipe(_recipe("scales_only", learnable=False))
    assert load_recipe(_recipe("scales_only")).train == "scales_only"
