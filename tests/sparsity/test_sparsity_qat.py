"""2:4 sparsity through prepare_qat: masks before the weight quantizer, dense layers listed
with reasons (also in the prepare report), the user's schedule step, state_dict round trip."""
import pytest
import torch
from torch import nn

import dal
import dal.sparsity as sp
from dal.hardware import load_hardware
from dal_examples.zoo import MnistCNN
from sparsity_qat_helpers import engine_weight, max_nonzeros_per_group

X = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
SPARSE = {"down.0", "conv", "down2.0", "head"}      # stem.0 has one input channel


def _prepared(seed=0, **kw):
    torch.manual_seed(seed)
    return dal.prepare_qat(MnistCNN(), recipe="int8_sparse24", hardware="a2000",
                           example_inputs=(X[:1],), **kw)


def test_prepare_qat_masks_qat_modules_and_quantized_weights_are_24():
    model = _prepared()
    ctl = sp.controller_of(model)
    assert set(ctl.layers) == SPARSE
    assert type(ctl.schedule) is sp.OneShot                  # one-shot by default
    for name in SPARSE:
        mod = model.get_submodule(name)
        assert hasattr(mod, "weight_quant") and mod.weight_mask.dtype == torch.bool
        assert max_nonzeros_per_group(mod.weight, 1) == 2     # stored weight, at prepare time
    dal.calibrate(model, [X], progress=False)
    model.eval()
    for name in SPARSE:                                       # what the engine multiplies
        w = engine_weight(model.get_submodule(name))
        assert max_nonzeros_per_group(w, 1) == 2, name
        assert (w != 0).float().mean() > 0.45, name           # and not trivially all zero
    assert sp.report(model).all_valid


def test_dense_layers_listed_with_reasons_in_both_reports():
    model = _prepared()
    skipped = sp.report(model).skipped
    assert skipped == {"stem.0": "input channels = 1 is not a multiple of 4"}
    rows = {r.name: r for r in dal.prepared(model).report.rows}
    assert rows["stem.0"].status == "quantized"               # dense, still quantized
    assert "dense (2:4 not possible: input channels = 1 is not a multiple of 4)" in rows["stem.0"].detail
    assert "sparse=2:4" not in rows["stem.0"].detail
    assert all("sparse=2:4" in rows[n].detail for n in SPARSE)
    text = str(dal.prepared(model).report)
    assert "4 of 5 layer(s) the recipe asks for are sparse; left dense: stem.0 (input channels = 1" in text
    assert "controller_of(model).step()" in text


@pytest.mark.parametrize("hw", ["a1000", "generic_int8"])
def test_hardware_without_sparse_engine_leaves_every_layer_dense(hw):
    torch.manual_seed(0)
    model = dal.prepare_qat(MnistCNN(), recipe="int8_sparse24", hardware=hw, example_inputs=(X[:1],))
    ctl = sp.controller_of(model)                              # the user's loop still works
    assert ctl.layers == {}
    ctl.step()
    skipped = sp.report(model).skipped
    assert skipped["head"] == f"hardware {hw} cannot run linear with sparse weights"
    assert skipped["conv"] == f"hardware {hw} cannot run conv with sparse weights"
    text = str(dal.prepared(model).report)
    assert "0 of 5 layer(s)" in text and f"down.0, conv, down2.0 (hardware {hw} cannot run conv" in text
    assert all(getattr(m, "weight_mask", None) is None for m in model.modules())


def test_depthwise_and_non_multiple_of_4_stay_dense():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 8, 3, padding=1)                 # 3 input channels
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)      # depthwise
            self.b = nn.Conv2d(8, 16, 1)
            self.fc = nn.Linear(16, 6)
            self.fc2 = nn.Linear(6, 4)                             # in_features 6

        def forward(self, x):
            y = torch.relu(self.b(self.dw(torch.relu(self.a(x)))))
            return self.fc2(torch.relu(self.fc(y.mean((2, 3)))))

    model = dal.prepare_qat(Net(), recipe="int8_sparse24", hardware="a2000",
                            example_inputs=(torch.randn(1, 3, 8, 8),))
    assert set(sp.controller_of(model).layers) == {"b", "fc"}
    skipped = sp.report(model).skipped
    assert skipped["a"] == "input channels = 3 is not a multiple of 4"
    assert "depthwise" in skipped["dw"]
    assert skipped["fc2"] == "in_features = 6 is not a multiple of 4"


def test_user_loop_steps_schedule_prepared_before_prepare_qat():
    """prepare_sparse (any schedule) on the float model, then prepare_qat: the QAT modules take
    the masks over, the controller moves to the returned (fx) root, auto_step drives it."""
    torch.manual_seed(0)
    model = MnistCNN()
    sp.prepare_sparse(model, schedule=sp.Gradual(steps=4), hardware=load_hardware("a2000"))
    qat = dal.prepare_qat(model, recipe="int8_sparse24", hardware="a2000", example_inputs=(X[:1],))
    assert "kept" in str(dal.prepared(qat).report)
    ctl = sp.controller_of(qat)
    assert set(ctl.layers) == SPARSE and isinstance(ctl.schedule, sp.Gradual)
    assert hasattr(ctl.module("head"), "weight_quant")          # the QAT module, not the float one
    dal.calibrate(qat, [X], progress=False)
    opt = torch.optim.SGD(qat.parameters(), lr=0.01, momentum=0.9)
    ctl.attach(opt, auto_step=True)
    densities = []
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(qat(X), torch.arange(4)).backward()
        opt.step()
        densities.append(float((qat.head.weight != 0).float().mean()))
    assert ctl.current_step == 5
    assert densities[0] > 0.8 and densities[-1] == 0.5        # the ramp ran
    assert sp.report(qat).all_valid


def test_state_dict_round_trip_into_freshly_prepared_model():
    model = _prepared(seed=0)
    dal.calibrate(model, [X], progress=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), torch.arange(4)).backward()
        opt.step()
        sp.controller_of(model).step()
    state = model.state_dict()
    fresh = _prepared(seed=1)                                  # other weights -> other masks
    assert any(not torch.equal(fresh.get_submodule(n).weight_mask, model.get_submodule(n).weight_mask)
               for n in SPARSE)
    fresh.load_state_dict(state)
    for n in SPARSE:
        assert torch.equal(fresh.get_submodule(n).weight_mask, model.get_submodule(n).weight_mask)
    assert sp.controller_of(fresh).current_step == 3
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(X), fresh(X))
    # the loaded masks are the ones enforced while training goes on (buffers updated in place)
    fresh.train()
    opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(fresh(X), torch.arange(4)).backward()
        opt.step()
    for n in SPARSE:
        mod = fresh.get_submodule(n)
        assert not mod.weight[~model.get_submodule(n).weight_mask].any(), n


def test_mixed_patterns_in_one_recipe_are_refused():
    recipe = {"name": "mixed", "rules": [
        {"type": "linear", "sparsity": "1:4", "weight": {"format": "int8", "granularity": "per_channel"}},
        {"type": "conv", "sparsity": "2:4", "weight": {"format": "int8", "granularity": "per_channel"}}]}
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"one N:M pattern.*1:4 on head.*2:4 on"):
        dal.prepare_qat(MnistCNN(), recipe=recipe, example_inputs=(X[:1],))


@pytest.mark.parametrize("spec,expected", [
    (None, sp.OneShot()), ("one_shot", sp.OneShot()),
    ({"kind": "gradual", "steps": 100, "every": 10}, sp.Gradual(steps=100, every=10)),
    ({"kind": "recompute_then_freeze", "every": 5, "freeze_at": 20},
     sp.RecomputeThenFreeze(every=5, freeze_at=20))])
def test_schedule_from_plain_data(spec, expected):
    """The form a recipe can carry (``sparsity_schedule:``), resolved by prepare_qat."""
    from dal.sparsity.schedule import resolve_schedule

    assert resolve_schedule(spec) == expected


@pytest.mark.parametrize("spec,match", [
    ("gradual", "needs arguments"), ({"kind": "cubic"}, "'kind' must be one of"),
    ({"kind": "gradual", "step": 3}, r"no field\(s\) \['step'\]"),
    ({"kind": "gradual"}, "missing 1 required")])
def test_schedule_from_plain_data_errors(spec, match):
    from dal.sparsity.schedule import resolve_schedule

    with pytest.raises(ValueError, match=match):
        resolve_schedule(spec)


def test_qat_modules_get_masked_gradients_without_a_hook():
    """The QAT forward multiplies the mask into the weight, so autograd masks the gradient; the
    controller adds no second multiply (a tensor hook) for QAT modules."""
    model = _prepared()
    dal.calibrate(model, [X], progress=False)
    for name in SPARSE:
        assert not model.get_submodule(name).weight._backward_hooks, name
    nn.functional.cross_entropy(model(X), torch.arange(4)).backward()
    for name in SPARSE:
        mod = model.get_submodule(name)
        assert mod.weight.grad[mod.weight_mask].abs().sum() > 0, name
        assert not mod.weight.grad[~mod.weight_mask].any(), name


def test_recipe_sparsity_schedule_reaches_the_controller(tmp_path):
    rec = dal.load_recipe("int8_sparse24").to_dict()
    rec["sparsity_schedule"] = {"kind": "gradual", "steps": 40, "every": 10}
    path = tmp_path / "gradual.yaml"
    path.write_text(dal.load_recipe(rec).to_yaml())
    loaded = dal.load_recipe(str(path))
    assert loaded.schedule_data() == {"kind": "gradual", "steps": 40, "every": 10}
    torch.manual_seed(0)
    model = dal.prepare_qat(MnistCNN(), recipe=loaded, hardware="a2000", example_inputs=(X[:1],))
    ctl = sp.controller_of(model)
    assert ctl.schedule == sp.Gradual(steps=40, every=10)
    assert "schedule Gradual" in "\n".join(dal.prepared(model).report.notes)


def test_bad_recipe_sparsity_schedule_names_file_line_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    text = dal.load_recipe("int8_sparse24").to_yaml()
    text = text.replace("rules:\n", "sparsity_schedule: {kind: gradual, step: 3}\nrules:\n", 1)
    path.write_text(text)
    line = text.splitlines().index("sparsity_schedule: {kind: gradual, step: 3}") + 1
    with pytest.raises(ValueError) as err:
        dal.prepare_qat(MnistCNN(), recipe=str(path), hardware="a2000", example_inputs=(X[:1],))
    msg = str(err.value)
    assert f"bad.yaml:{line}" in msg and "sparsity_schedule" in msg and "'step'" in msg


def test_recipe_sparsity_schedule_of_the_wrong_type_is_a_recipe_error(tmp_path):
    from dal.recipe import RecipeError

    rec = dal.load_recipe("int8_sparse24").to_dict()
    rec["sparsity_schedule"] = 3
    with pytest.raises(RecipeError, match="sparsity_schedule"):
        dal.load_recipe(rec)
