"""dal.search_precision on the briefly trained house MNIST CNN: budgets are kept, the recipe is a
file prepare accepts whose estimate is the search's own figure, infeasible budgets and hardware
without cost keys are refused, and the searched recipe QATs, exports and runs on dal.npu."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import dal
from dal.cost import estimate, search_precision
from dal.hardware.cost import MissingCostError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mnist_helpers import accuracy, trained_mnist  # noqa: E402


@pytest.fixture(scope="module")
def mnist():
    torch.set_num_threads(1)
    return trained_mnist()


@pytest.mark.parametrize("method", ["fisher", "output_error"])
@pytest.mark.parametrize("budget", ["1.0x", "0.8x", "0.6x"])
def test_budget_is_kept_and_recipe_rebuilds_it(mnist, tmp_path, method, budget):
    model, calib, _ = mnist
    res = search_precision(model, calib, "a2000", latency_budget=budget, method=method)
    assert res.latency_ms <= res.latency_budget_ms
    assert res.latency_budget_ms == pytest.approx(float(budget[:-1]) * res.int8_latency_ms)
    path = tmp_path / "searched.yaml"
    res.recipe.to_yaml(path)
    recipe = dal.load_recipe(path)
    assert recipe == res.recipe
    x = calib[0][0]
    q = dal.prepare_qat(copy.deepcopy(model), recipe=recipe, hardware="a2000", example_inputs=(x,))
    est = estimate(q, example_inputs=(x,))
    assert est.total_ms == pytest.approx(res.latency_ms) and est.total_ms <= res.latency_budget_ms
    shown = {r.geom.name: r.choice for r in est.rows}
    for name, key in res.choice.items():
        assert shown[name].weight.name == key.split("+")[0] and shown[name].sparse == key.endswith("+2:4")
    assert all(p[0] <= res.latency_budget_ms * (1 + 1e-9) for p in res.front)
    assert "| latency (ms) |" in res.pareto_table()


def test_more_budget_never_scores_worse(mnist):
    model, calib, _ = mnist
    scores = [search_precision(model, calib, "a2000", latency_budget=b).score for b in ("0.6x", "0.8x", "1.0x")]
    assert scores == sorted(scores, reverse=True)


def test_size_budget(mnist):
    model, calib, _ = mnist
    res = search_precision(model, calib, "a2000", size_budget="0.5x", method="output_error")
    assert res.size_bytes <= 0.5 * res.int8_size_bytes


def test_infeasible_budget_names_the_smallest_achievable(mnist):
    model, calib, _ = mnist
    with pytest.raises(ValueError, match=r"smallest achievable latency is [0-9.e-]+ ms \(0\.\d+x INT8\)"):
        search_precision(model, calib, "a2000", latency_budget="0.1x")


def test_int8_only_hardware_has_nothing_cheaper_than_int8(mnist):
    model, calib, _ = mnist
    res = search_precision(model, calib, "a1000", latency_budget="1.0x")
    assert set(res.choice.values()) == {"int8"}
    with pytest.raises(ValueError, match="smallest achievable"):
        search_precision(model, calib, "a1000", latency_budget="0.99x")


def test_hardware_without_cost_is_refused_first(mnist):
    model, calib, _ = mnist
    d = dal.load_hardware("a2000").to_dict()
    d.pop("cost")
    with pytest.raises(MissingCostError, match="no 'cost' section"):
        search_precision(model, calib, d, latency_budget="0.8x")


def test_user_groups_share_one_candidate(mnist):
    model, calib, _ = mnist
    res = search_precision(model, calib, "a2000", latency_budget="0.7x", groups=[["down.0", "conv", "down2.0"]])
    assert len({res.choice[n] for n in ("down.0", "conv", "down2.0")}) == 1
    assert ["down.0", "conv", "down2.0"] in res.groups


def test_searched_recipe_trains_exports_and_runs_on_npu(mnist, tmp_path):
    """QAT a few steps, export, dal.verify: layer by layer within 1 LSB of dal.npu (at batch 4 the
    layer overhead weighs more: 0.6x of INT8 is below the smallest achievable 0.635x, so 0.7x)."""
    from dal_examples.training import train_epoch

    model, calib, test = mnist
    x = calib[0][0][:4]
    res = search_precision(model, calib, "a2000", latency_budget="0.7x", example_inputs=(x,))  # batch 4
    q = dal.prepare_qat(copy.deepcopy(model), recipe=res.recipe, hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, calib, progress=False)
    train_epoch(q, calib, torch.optim.SGD(q.parameters(), lr=0.01, momentum=0.9))
    dal.set_quantizer_state(q, "frozen")
    q.eval()
    assert accuracy(q, test) > 80.0
    path = str(tmp_path / "searched.onnx")
    dal.export_onnx(q, (x,), path)
    assert estimate(path).total_ms == pytest.approx(res.latency_ms)
    report = dal.verify(path, q, (x,))
    assert report.layers and report.max_layer_lsb_forced <= 1
    assert report.max_torch_layer_lsb <= 1


def test_pareto_points_measured(mnist):
    """Measured accuracy of front points (PTQ): the table shows it; the cheapest point (all int4 +
    2:4, no training) is measured too."""
    model, calib, test = mnist
    res = search_precision(model, calib, "a2000", latency_budget="0.9x")
    got = res.measure(model, calib, lambda q: accuracy(q, test), "a2000", (calib[0][0],), points=3)
    assert len(got) == 3 and all(0 <= v <= 100 for v in got.values())
    table = res.pareto_table()
    assert table.count("\n") == 1 + 3 and f"{max(got.values()):.4g}" in table
    assert max(got.values()) > 80.0
    assert res.recipe_for(res.front[0][3]).rules[0].to_dict()["match"] in res.choice


def _with_int16():
    """a2000 plus int16 weights and activations on conv / linear (a DSP-like wide mode)."""
    d = dal.load_hardware("a2000").to_dict()
    d["name"] = "a2000_int16"
    d["accumulator_bits"] = 48  # int16 x int16 products over hundreds of terms need more than 32 bits
    d["engines"]["matrix"]["formats"].append("int16")
    for op in ("conv", "linear"):
        d["ops"][op]["weight_formats"].append("int16")
        d["ops"][op]["input_formats"].append("int16")
        d["ops"][op]["output_formats"].append("int16")
    d["cost"]["engines"]["matrix"]["macs_per_cycle"]["int16"] = 1024
    return d


def test_int16_candidate_where_the_hardware_offers_it(mnist):
    model, calib, _ = mnist
    hw = _with_int16()
    res = search_precision(model, calib, hw, latency_budget="2.0x", candidates=("int8", "int16"), sparsity=("dense",))
    assert set(res.scores["conv"]) == {"int8", "int16"}
    assert res.scores["conv"]["int16"] < res.scores["conv"]["int8"]  # finer grid, smaller perturbation
    with16 = next(p for p in res.front if "int16" in p[3].values())
    q = dal.prepare_qat(copy.deepcopy(model), recipe=res.recipe_for(with16[3]), hardware=hw,
                        example_inputs=(calib[0][0],))
    est = estimate(q, example_inputs=(calib[0][0],))
    assert est.total_ms == pytest.approx(with16[0])
    assert any(r.choice.weight.name == "int16" for r in est.rows if r.choice and r.choice.weight)


def test_w8a16_on_a_16_bit_activation_mode(mnist):
    """pow2_int8 has int16 activations but only 8-bit weights: the int16 candidate is W8A16."""
    model, calib, _ = mnist
    res = search_precision(model, calib, "pow2_int8", latency_budget="1.5x", base_recipe="pow2_int8")
    assert set(res.scores["conv"]) == {"int8", "w8a16"}
    point = next(p for p in res.front if "w8a16" in p[3].values())
    x = calib[0][0]
    q = dal.prepare_qat(copy.deepcopy(model), recipe=res.recipe_for(point[3]), hardware="pow2_int8", example_inputs=(x,))
    est = estimate(q, example_inputs=(x,))
    assert est.total_ms == pytest.approx(point[0])
    assert any(r.choice.label == "wint8/aint16" for r in est.rows)


class _Branches(torch.nn.Module):
    """A stem, two conv branches concatenated (torch.cat), then a head; as in an Inception block
    the second branch pools first, so the two convs read different tensors."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, stride=2, padding=1), torch.nn.ReLU())
        self.a = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 1), torch.nn.ReLU())
        self.pool = torch.nn.MaxPool2d(3, stride=1, padding=1)
        self.head = torch.nn.Sequential(torch.nn.Conv2d(48, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))

    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.cat([self.a(x), self.b(self.pool(x))], dim=1))


def _branches(calib):
    from dal_examples.training import train_epoch

    torch.manual_seed(0)
    net = _Branches()
    train_epoch(net, calib, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    return net.eval()


def test_shared_scale_cat_branches_take_one_format(mnist, tmp_path):
    """pow2_int8 concatenates without requantizing (shared_scale: [cat]): the two branches feeding
    the cat form one group, so every front point gives them one candidate; the searched recipe
    prepares, exports and runs layer by layer within 1 LSB of dal.npu. a2000 requantizes a cat, so
    there the branches are searched apart and the front has points where they differ."""
    _, calib, _ = mnist
    net = _branches(calib)
    x = calib[0][0][:4]
    res = search_precision(net, calib, "pow2_int8", latency_budget="4x", base_recipe="pow2_int8",
                           example_inputs=(x,))
    assert ["a.0", "b.0"] in res.groups
    assert {p[3]["a.0"] for p in res.front} == {"int8", "w8a16"}  # both candidates appear on the front ...
    assert all(p[3]["a.0"] == p[3]["b.0"] for p in res.front)     # ... always for both branches at once
    q = dal.prepare_qat(copy.deepcopy(net), recipe=res.recipe, hardware="pow2_int8", example_inputs=(x,))
    dal.calibrate(q, calib, progress=False)
    dal.set_quantizer_state(q, "frozen")
    q.eval()
    path = str(tmp_path / "branches.onnx")
    dal.export_onnx(q, (x,), path)
    report = dal.verify(path, q, (x,))
    assert report.layers and report.max_layer_lsb_forced <= 1
    assert report.max_torch_layer_lsb <= 1

    free = search_precision(net, calib, "a2000", latency_budget="0.8x", example_inputs=(x,))
    assert not any("a.0" in g and "b.0" in g for g in free.groups)
    assert any(p[3]["a.0"] != p[3]["b.0"] for p in free.front)
