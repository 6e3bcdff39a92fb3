"""dal.estimate: MACs against torch's own FLOP counter, prepared model against its exported file,
the table and engine breakdown, and the errors for a hardware model without cost keys."""
import pytest
import torch
import torchvision
from torch.utils.flop_counter import FlopCounterMode

import dal
from dal.cost import estimate
from dal.hardware.cost import MissingCostError
from dal_examples.zoo import MnistCNN

W4A8 = {"name": "w4a8_all", "rules": [  # int4 weights on every conv / linear
    {"type": ["conv", "linear"], "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True},
     "input": {"format": "int8"}},
    {"type": ["add", "pool"], "input": {"format": "int8"}}]}


def _flop_macs(model, x) -> int:
    """torch.utils.flop_counter counts 2 FLOPs per multiply-accumulate of conv / mm / attention.
    MHA's inference fast path (one fused op) has no FLOP formula: the counter sees 0 for it, so
    it is turned off here (FACTS.md: the same fast path breaks the TorchScript exporter); and
    the CPU's fused SDPA kernel has none either, so attention runs its math path (two bmm)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
    return counter.get_total_flops() // 2


@pytest.mark.parametrize("name,factory,shape", [
    ("resnet18", torchvision.models.resnet18, (1, 3, 32, 32)),
    ("mobilenet_v2", torchvision.models.mobilenet_v2, (1, 3, 32, 32)),
    ("vit_b_16", lambda: torchvision.models.vit_b_16(image_size=32), (1, 3, 32, 32)),
])
def test_macs_equal_torch_flop_counter(name, factory, shape):
    torch.manual_seed(0)
    model = factory().eval()
    x = torch.randn(shape)
    expected = _flop_macs(model, x)
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))  # in place: no copy
    est = estimate(q, example_inputs=(x,))
    print(f"{name}: dal.estimate {est.macs:,} MACs, FlopCounterMode {expected:,}")
    assert est.macs == expected and est.macs > 10**6
    assert sum(e["macs"] for e in est.by_engine.values()) == est.macs


@pytest.mark.parametrize("recipe", ["int8_balanced", "int8_sparse24", "w4a8_fp8_performance", "fp16_precision"])
def test_prepared_model_and_exported_file_agree(tmp_path, recipe):
    """Two independent readings (torch modules + quantizers vs ONNX graph + element types) give
    the same layers, formats, MACs and cycles."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN().eval(), recipe=recipe, hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    path = tmp_path / "m.onnx"
    dal.export_onnx(q, (x,), str(path))
    a, b = estimate(q, example_inputs=(x,)), estimate(path)
    assert [(r.geom.name, r.geom.macs, r.choice.label, r.engine) for r in a.rows] == \
        [(r.geom.name, r.geom.macs, r.choice.label, r.engine) for r in b.rows]
    assert a.total_cycles == pytest.approx(b.total_cycles)
    if recipe == "int8_sparse24":  # stem.0 has one input channel: prepare leaves it dense
        assert [r.geom.name for r in b.rows if r.choice.sparse] == ["down.0", "conv", "down2.0", "head"]


def test_table_total_and_breakdown():
    x = torch.randn(1, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN().eval(), recipe="int8_balanced", hardware="a1000", example_inputs=(x,))
    est = estimate(q, example_inputs=(x,))
    text = str(est)
    assert "stem.0" in text and "engine matrix" in text and "engine vector" in text
    assert est.total_cycles == pytest.approx(sum(e["cycles"] for e in est.by_engine.values()))
    assert est.total_ms == pytest.approx(est.total_cycles / 800e3)  # a1000: 800 MHz
    assert est.to_dict()["layers"][0]["name"] == "stem.0"


def test_recipes_order_on_a2000():
    """fp16 > int8 > w4a8 and int8 > int8 2:4 on the same model (the knobs move the total)."""
    x = torch.randn(64, 1, 28, 28)
    ms = {}
    for recipe in ["fp16_precision", "int8_balanced", "int8_sparse24", "w4a8_fp8_performance"]:
        q = dal.prepare_qat(MnistCNN().eval(), recipe=recipe, hardware="a2000", example_inputs=(x[:2],))
        ms[recipe] = estimate(q, example_inputs=(x,)).total_ms
    assert ms["fp16_precision"] > ms["int8_balanced"] > ms["w4a8_fp8_performance"]
    assert ms["int8_balanced"] > ms["int8_sparse24"]


def _without_cost(name="a2000"):
    d = dal.load_hardware(name).to_dict()
    d.pop("cost")
    d["name"] = "nocost"
    return d


def test_hardware_without_cost_section_names_the_keys():
    x = torch.randn(1, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN().eval(), recipe="int8_balanced", hardware=_without_cost(), example_inputs=(x,))
    with pytest.raises(MissingCostError, match="no 'cost' section.*clock_mhz, dram_gb_per_s, layer_overhead_cycles"):
        estimate(q, example_inputs=(x,))


def test_missing_rate_is_named_with_its_key():
    d = dal.load_hardware("a2000").to_dict()
    del d["cost"]["engines"]["matrix"]["macs_per_cycle"]["int4"]
    del d["cost"]["engines"]["vector"]
    x = torch.randn(1, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN().eval(), recipe=W4A8, hardware=d, example_inputs=(x,))
    with pytest.raises(MissingCostError) as err:
        estimate(q, example_inputs=(x,))
    text = str(err.value)
    assert "missing cost key cost.engines.matrix.macs_per_cycle.int4 (needed by stem.0, down.0, conv, down2.0 " \
        "and 1 more)" in text
    assert "missing cost key cost.engines.vector.elements_per_cycle.int8 (needed by add, pool)" in text
    assert len(err.value.problems) == 2


def test_bad_cost_yaml_is_located(tmp_path):
    text = open(dal.load_hardware("a2000").source).read()
    text = text.replace("clock_mhz: 1000", "clock_mhz: fast").replace("fp16: 1024}", "fp16: 1024, int16: 9}")
    text = text.replace("  layer_overhead_cycles: 200\n", "  layer_overhead_cycles: 200\n  dram: 3\n")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    lines = text.splitlines()
    with pytest.raises(dal.hardware.HardwareModelError) as err:
        dal.load_hardware(path)
    msg = str(err.value)
    at = {key: next(i + 1 for i, l in enumerate(lines) if l.strip().startswith(key)) for key in ("clock_mhz", "dram:")}
    assert f"bad.yaml:{at['clock_mhz']}: cost.clock_mhz: expected a number, got 'fast'" in msg
    assert f"bad.yaml:{at['dram:']}: cost.dram: unknown key 'dram'" in msg
    assert "cost.engines.matrix.macs_per_cycle.int16: int16 is not a format of this engine" in msg
