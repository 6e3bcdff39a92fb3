"""prepare_sparse: layer selection, skip reasons, forward oracle, state_dict, resnet18."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal.sparsity as sp
from sparsity_helpers import tiny_batch, tiny_model


class NoConvHardware:
    name = "npu-x"

    def supports_sparsity(self, op_class):
        return op_class == "linear"


class MyQLinear(nn.Linear):   # stands in for dal.nn.QLinear: a torch subclass
    pass


def test_skip_reasons_and_selection():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),                        # 3 input channels
        nn.Conv2d(8, 8, 3, groups=8),              # depthwise
        nn.Conv2d(8, 16, 3),                       # sparse
        nn.ConvTranspose2d(16, 8, 2),              # sparse (axis 0)
        nn.Flatten(), nn.LazyLinear(4),            # uninitialized
        MyQLinear(8, 6), nn.Linear(6, 4))          # subclass sparse; 6 not multiple of 4
    sp.prepare_sparse(model)
    skipped = sp.report(model).skipped
    assert set(skipped) == {"0", "1", "5", "7"}
    assert "3 is not a multiple of 4" in skipped["0"]
    assert "depthwise" in skipped["1"]
    assert "lazy" in skipped["5"]
    assert "in_features = 6" in skipped["7"]
    assert isinstance(model[6].weight_mask, torch.Tensor)
    wt = model[3].weight.detach()                 # ConvTranspose: groups along dim 0
    assert ((wt.movedim(0, -1).reshape(-1, 4) != 0).sum(1) <= 2).all()


def test_hardware_and_layer_filters():
    model = sp.prepare_sparse(tiny_model(), hardware=NoConvHardware(),
                              layers=lambda name, m: name != "9")
    skipped = sp.report(model).skipped
    assert "hardware npu-x cannot run conv" in skipped["0"]
    assert skipped["9"] == "excluded by the layers filter"
    assert [r["name"] for r in sp.report(model).sparse] == ["7"]
    model2 = sp.prepare_sparse(tiny_model(), layers={"3"})
    assert [r["name"] for r in sp.report(model2).sparse] == ["3"]


@pytest.mark.parametrize("pattern,ok", [("2:4", True), ("1:4", True), ("4:8", True),
                                        ("2:4:8", False), ("4:4", False), ("dense", False),
                                        ("0:4", False)])
def test_patterns(pattern, ok):
    if not ok:
        with pytest.raises(ValueError, match="N:M|invalid"):
            sp.prepare_sparse(tiny_model(), pattern=pattern)
        return
    n, m = map(int, pattern.split(":"))
    model = nn.Sequential(nn.Linear(16, 8), nn.Conv1d(8, 8, 1))
    sp.prepare_sparse(model, pattern=pattern)
    for mod in model:
        mask = mod.weight_mask.movedim(1, -1).reshape(-1, m)
        assert (mask.sum(1) == n).all()
    assert sp.report(model).pattern == pattern and sp.report(model).all_valid


def test_forward_equals_plain_torch_oracle():
    torch.manual_seed(0)
    lin, conv = nn.Linear(16, 8), nn.Conv2d(8, 12, 3, padding=1)
    w_lin, w_conv = lin.weight.detach().clone(), conv.weight.detach().clone()
    sp.prepare_sparse(nn.Sequential(conv, nn.ReLU()))
    sp.prepare_sparse(nn.Sequential(lin))
    x, xc = torch.randn(5, 16), torch.randn(2, 8, 4, 4)
    ref_lin = F.linear(x, w_lin * lin.weight_mask, lin.bias)
    ref_conv = F.conv2d(xc, w_conv * conv.weight_mask, conv.bias, padding=1)
    assert torch.equal(lin(x), ref_lin)
    assert torch.equal(conv(xc), ref_conv)
    # the masks are the magnitude masks of the original weights (independent oracle)
    g = w_lin.abs().reshape(-1, 4)
    top = torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True)
    assert torch.equal(lin.weight_mask, top.view_as(w_lin))
    # dense weights written behind the controller's back are masked in the next forward
    with torch.no_grad():
        lin.weight.copy_(w_lin)
    assert torch.equal(lin(x), ref_lin)
    assert not lin.weight.detach()[~lin.weight_mask].any()
    # several forwards before one backward: no in-place error
    (lin(x).sum() + lin(x).sum()).backward()
    assert not lin.weight.grad[~lin.weight_mask].any()


def test_state_dict_round_trip_resumes_exactly():
    sched = sp.Gradual(steps=20, every=2)
    a = sp.prepare_sparse(tiny_model(0), schedule=sched)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05)

    def run(model, opt, steps, start):
        for s in range(start, start + steps):
            x, y = tiny_batch(s)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            sp.controller_of(model).step()

    run(a, opt_a, 7, 0)
    sd = a.state_dict()
    assert {"0.weight_mask", "0.weight_sparsity_stats", "9.weight_mask"} <= set(sd)
    b = sp.prepare_sparse(tiny_model(1), schedule=sched)      # different init
    b.load_state_dict(sd)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.05)
    assert sp.controller_of(b).current_step == 7
    run(a, opt_a, 20, 7)
    run(b, opt_b, 20, 7)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert sp.report(b).all_valid


def test_resnet18_prepare_and_complete_report():
    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18(weights=None).eval()
    sp.prepare_sparse(model)
    rep = sp.report(model)
    convs = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert [r["name"] for r in rep.rows] == convs
    assert rep.skipped == {"conv1": "input channels = 3 is not a multiple of 4"}
    assert len(rep.sparse) == len(convs) - 1 and rep.all_valid
    for r in rep.sparse:
        assert r["density"] == 0.5 and 0.5 < r["retained"] < 1.0
        m = model.get_submodule(r["name"])        # independent count on the stored weight
        nz = (m.weight.detach().permute(0, 2, 3, 1) if m.weight.dim() == 4
              else m.weight.detach()).reshape(-1, 4) != 0
        assert (nz.sum(1) <= 2).all()
    json.dumps(rep.rows)                           # plain data
    text = str(rep)
    assert "layer4.1.conv2" in text and "conv1" in text and "not a multiple" in text
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_masked_resnet_block_equals_oracle():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    dense = tv.models.resnet18(weights=None).layer2.eval()
    oracle = copy.deepcopy(dense)
    sparse = sp.prepare_sparse(dense)
    with torch.no_grad():
        for n, m in oracle.named_modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(sparse.get_submodule(n).weight_mask)
        x = torch.randn(1, 64, 16, 16)
        assert torch.equal(sparse(x), oracle(x))


def test_retained_fraction_and_remove():
    torch.manual_seed(0)
    lin = nn.Linear(32, 8)
    w = lin.weight.detach().clone()
    model = sp.prepare_sparse(nn.Sequential(lin))
    row = sp.report(model).rows[0]
    expect = float((w * lin.weight_mask).abs().sum() / w.abs().sum())
    assert abs(row["retained"] - expect) < 1e-6
    with pytest.raises(ValueError, match="already sparse"):
        sp.prepare_sparse(model)
    sp.controller_of(model).remove()
    assert getattr(lin, "weight_mask", None) is None and "weight_mask" not in model.state_dict()
    with pytest.raises(ValueError, match="no sparsity controller"):
        sp.controller_of(model)
    sp.prepare_sparse(model)                       # can be prepared again
