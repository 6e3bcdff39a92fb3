"""Functional ops in forwards torch.fx cannot trace are found by call site and quantized; a module
called several times in one forward trains, with one set of statistics; normalisations the
hardware runs (GroupNorm in FP16 on the a2000) or refuses (the a1000) by path."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.recipe.errors import RecipeError


class ListHead(nn.Module):
    """A head over a list of levels, as torchvision's: fx cannot iterate the list argument."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)  # one module, called once per level

    def forward(self, feats):
        outs = []
        for f in feats:
            outs.append(self.conv(f).flatten(2))
        return torch.cat(outs, dim=2)


class Pyramid(nn.Module):
    """A top-down sum over a list (FeaturePyramidNetwork's shape), a sigmoid gate, then the head."""

    def __init__(self, act=torch.sigmoid):
        super().__init__()
        self.lat = nn.ModuleList([nn.Conv2d(3, 4, 1) for _ in range(3)])
        self.head = ListHead()
        self.act = act

    def forward(self, x):
        levels = [x, F.max_pool2d(x, 2), F.max_pool2d(x, 4)]
        inner = [conv(t) for conv, t in zip(self.lat, levels)]
        out = [inner[-1]]
        for t in reversed(inner[:-1]):
            up = F.interpolate(out[0], size=t.shape[-2:], mode="nearest")
            out.insert(0, t + up)
        if x.shape[-1] >= 16:  # Python control flow on a shape: torch.fx cannot trace this forward
            out = [self.act(o) for o in out]
        return self.head(out)


def _x(seed=0):
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _rows(model):
    return {r.name: r for r in dal.prepared(model).report.rows}


def _calibrated(hardware="a2000"):
    m = dal.prepare_qat(Pyramid(), recipe="int8_balanced", hardware=hardware,
                        example_inputs=(_x(),), quantize_outputs=True)
    dal.calibrate(m, [_x(1), _x(2)])
    return m


def test_sites_of_an_untraceable_forward_are_listed_and_quantized():
    m = dal.prepare_qat(Pyramid(), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(_x(),), quantize_outputs=True)
    rows = _rows(m)
    assert "root" in " ".join(dal.prepared(m).report.notes)  # the root's forward was captured by call site
    adds = sorted(n for n in rows if ".add_l" in n)
    cats = [n for n in rows if n.startswith("head.dal_sites.cat_l")]
    assert len(adds) == 2 and all(rows[n].status == "quantized" and rows[n].type_name == "QAdd" for n in adds)
    assert len(cats) == 1 and rows[cats[0]].type_name == "QCat"
    assert sum(".sigmoid_l" in n for n in rows) == 3  # one row per call: a float op, checked against the hardware
    assert all("runs in FP16" in rows[n].detail for n in rows if ".sigmoid_l" in n)
    assert any(".nearest_l" in n and rows[n].status == "passthrough" for n in rows)
    assert isinstance(m.dal_sites[adds[0].split(".")[-1]], dal.nn.QAdd)


def test_a_routed_site_puts_its_output_on_the_quantizer_grid():
    m = _calibrated().eval()
    cat = next(mod for name, mod in m.head.dal_sites.items() if name.startswith("cat_l"))
    seen = []
    handle = cat.register_forward_hook(lambda mod, i, o: seen.append((i, o)))
    with torch.no_grad():
        m(_x(3))
    handle.remove()
    (inputs, out), = seen
    assert len(inputs) == 3  # one input per level: the call was routed to the QCat
    for t, q in zip(inputs, cat.input_quants):
        codes = q(t) / q.scale  # fake-quantized inputs are integer multiples of their scale
        torch.testing.assert_close(codes, torch.round(codes), rtol=0, atol=1e-4)
    # the cat of the fake-quantized inputs, by torch itself, then the output quantizer prepare gave
    # the model's output (the example forward showed this site produces it)
    assert cat.output_quant is not None
    expect = cat.output_quant(torch.cat([q(t) for t, q in zip(inputs, cat.input_quants)], dim=2))
    assert torch.equal(out, expect)


def test_a_float_site_the_hardware_cannot_run_is_refused_by_path():
    with pytest.raises(RecipeError, match=r"dal_sites\.sigmoid_l\d+_0 \(sigmoid\).*'a1000' cannot run"):
        dal.prepare_qat(Pyramid(), recipe="int8_balanced", hardware="a1000",
                        example_inputs=(_x(),), quantize_outputs=True)
    m = dal.prepare_qat(Pyramid(act=torch.relu), recipe="int8_balanced", hardware="a1000",
                        example_inputs=(_x(),), quantize_outputs=True)
    assert any(".relu_l" in r.name and r.status == "passthrough" for r in dal.prepared(m).report.rows)


def test_a_module_called_per_level_trains_with_one_set_of_statistics():
    m = _calibrated().train()
    conv = m.head.conv
    seen = []
    handle = conv.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    before = int(conv.input_quant.observer.batches_seen)
    loss = m(_x(4)).square().mean()
    loss.backward()  # failed before: the quantizer's scale was written in place between the calls
    handle.remove()
    assert len(seen) == 3 and conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    # one set of statistics for the three calls: the one input observer saw each level's input
    assert int(conv.input_quant.observer.batches_seen) - before == 3


def test_checkpoint_restores_the_site_quantizers():
    m = _calibrated()
    state = m.state_dict()
    assert any(k.startswith("dal_sites.add_l") and k.endswith("scale") for k in state)
    fresh = dal.prepare_qat(Pyramid(), recipe="int8_balanced", hardware="a2000",
                            example_inputs=(_x(),), quantize_outputs=True)
    fresh.load_state_dict(state)
    m.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(m(_x(5)), fresh(_x(5)))


class GnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x):
        return torch.relu(self.gn(self.conv(x)))


def test_groupnorm_is_fp16_on_fp16_hardware_and_refused_on_int8_only():
    m = dal.prepare_qat(GnBlock(), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(_x(),), quantize_outputs=True)
    row = _rows(m)["gn"]
    assert row.status == "fp16" and row.type_name == "Fp16GroupNorm"
    ref = GnBlock()
    ref.load_state_dict({k: v for k, v in m.state_dict().items() if "quant" not in k}, strict=False)
    dal.calibrate(m, [_x(1)])
    with torch.no_grad():
        y = m.gn(ref.conv(_x(2)))
        # torch's own group norm of the FP16-rounded input, rounded to FP16: the contract
        expect = F.group_norm(ref.conv(_x(2)).half().float(), 2, m.gn.weight.half().float(),
                              m.gn.bias.half().float(), m.gn.eps).half().float()
    torch.testing.assert_close(y, expect, rtol=0, atol=0)
    with pytest.raises(RecipeError, match=r"gn \(GroupNorm\).*'a1000' cannot run.*replace the layer by a BatchNorm2d"):
        dal.prepare_qat(GnBlock(), recipe="int8_balanced", hardware="a1000",
                        example_inputs=(_x(),), quantize_outputs=True)


class GnListHead(nn.Module):
    """A conv + GroupNorm tower called once per level inside one forward (FCOS's head)."""

    def __init__(self):
        super().__init__()
        self.tower = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU())
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        feats = [x, F.max_pool2d(x, 2), F.max_pool2d(x, 4)] if x.shape[-1] >= 8 else [x]  # fx cannot trace this
        outs = [self.out(self.tower(f)).permute(0, 2, 3, 1).reshape(f.shape[0], -1, 2) for f in feats]
        return torch.cat(outs, dim=1)


def _levels(seed):
    return torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


def _train_step(model, feats):
    model.zero_grad(set_to_none=True)
    out = model(feats)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_cat_of_permuted_views_quantizes_each_view_as_it_is():
    """A cat's input quantizers get the permuted views themselves (no copy: the fused kernel takes
    dense views, and dal.convert's fan-out groups read tensors by identity); the result is each
    quantizer on its view, then torch.cat."""
    import copy

    m = dal.prepare_qat(GnListHead(), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(_levels(0),), quantize_outputs=True)
    dal.calibrate(m, [_levels(1)])
    cat = next(mod for name, mod in m.dal_sites.items() if name.startswith("cat_l"))
    ref = copy.deepcopy(cat)
    m.train(), ref.train()
    views = [torch.randn(2, 2, s, s).permute(0, 2, 3, 1).reshape(2, -1, 2) for s in (4, 1, 2)]
    assert not views[0].is_contiguous() and cat.input_quants[0].state == "quantize"
    seen = []
    cat.input_quants[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].is_contiguous()))
    out = cat(*views)
    assert seen == [False]  # the view itself, not a contiguous copy
    # the reference: each quantizer called on the view itself (its eager path), then torch.cat
    expect = torch.cat([q(v) for q, v in zip(ref.input_quants, views)], dim=1)
    expect = ref.output_quant(expect) if ref.output_quant is not None else expect
    assert torch.equal(out, expect)
    state, ref_state = cat.state_dict(), ref.state_dict()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)


def test_an_owners_mode_leaves_the_stack_after_each_forward_also_one_that_raised():
    m = _calibrated()
    m.train()
    m(_x(3)).sum().backward()
    assert torch._C._len_torch_function_stack() == 0
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 5, 16, 16))  # the first lateral conv (3 input channels) raises
    assert torch._C._len_torch_function_stack() == 0
    assert torch.isfinite(m(_x(4))).all()  # and the next forward routes as before
