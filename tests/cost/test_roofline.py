"""The roofline is monotone in every knob, on every bundled hardware model (property tests).

Random layer geometries; for each, the cost of a format is compared with the cost of a wider
one, of 2:4 against dense, and of FP16 against INT8 on the int8-first matrix engines."""
import random

import pytest

import dal
from dal.cost.roofline import Choice, LayerGeom, layer_cost

HW = ["a1000", "a2000", "generic_int8"]


def _geoms(n=200, seed=0):
    rnd = random.Random(seed)
    for i in range(n):
        cin, cout, k, hw_ = rnd.choice([1, 3, 16, 30, 64, 256]), rnd.choice([8, 33, 64, 512]), rnd.choice([1, 3]), \
            rnd.choice([1, 7, 28, 56])
        macs = cout * hw_ * hw_ * cin * k * k
        yield LayerGeom(f"l{i}", rnd.choice(["conv", "linear"]), macs, cout * cin * k * k, cin * hw_ * hw_ * 4,
                        cout * hw_ * hw_, cin, cout)


def _cycles(hw, g, w, x, sparse=False):
    return layer_cost(g, Choice(w, x, sparse=sparse), hw.op(g.op_class).engine, hw).cycles


@pytest.mark.parametrize("name", HW)
def test_more_weight_bits_never_cost_less(name):
    hw = dal.load_hardware(name)
    ints = [f for f in ("int4", "int8") if dal.get_format(f) in hw.allowed_formats("conv", "weight")]
    x = hw.allowed_formats("conv", "input")[0]
    for g in _geoms():
        costs = [_cycles(hw, g, f, x) for f in ints]
        assert costs == sorted(costs), (g, costs)


def test_int4_strictly_cheaper_than_int8_when_compute_bound():
    hw = dal.load_hardware("a2000")
    g = LayerGeom("big", "conv", 10**9, 64 * 64 * 9, 10**4, 10**4, 64, 64)
    assert _cycles(hw, g, "int4", "uint8") < _cycles(hw, g, "int8", "uint8")


@pytest.mark.parametrize("name", HW)
def test_more_activation_bits_never_cost_less(name):
    hw = dal.load_hardware(name)
    for g in _geoms():
        if dal.get_format("fp16") in hw.allowed_formats("conv", "input"):
            assert _cycles(hw, g, "int8", "uint8") <= _cycles(hw, g, "fp16", "fp16")


def test_sparse_24_never_costs_more_and_saves_when_compute_bound():
    hw = dal.load_hardware("a2000")
    for g in _geoms():
        for w in ("int4", "int8", "fp16"):
            x = "fp16" if w == "fp16" else "uint8"
            assert _cycles(hw, g, w, x, sparse=True) <= _cycles(hw, g, w, x)
    g = LayerGeom("big", "conv", 10**9, 64 * 64 * 9, 10**4, 10**4, 64, 64)
    assert _cycles(hw, g, "int8", "uint8", True) < _cycles(hw, g, "int8", "uint8")


@pytest.mark.parametrize("name", ["a2000", "generic_int8"])
def test_fp16_costs_more_than_int8_on_int8_first_engines(name):
    hw = dal.load_hardware(name)
    for g in _geoms():
        assert _cycles(hw, g, "fp16", "fp16") > _cycles(hw, g, "int8", "uint8")


def test_channel_alignment_pads_compute():
    """A 3-channel input on a 32-aligned engine computes as 32 channels: exactly 32/3 the MAC time."""
    hw = dal.load_hardware("a2000")
    g3 = LayerGeom("c", "conv", 3 * 64 * 10**4, 3 * 64, 0, 0, 3, 64)
    g32 = LayerGeom("c", "conv", 32 * 64 * 10**4, 32 * 64, 0, 0, 32, 64)
    a = layer_cost(g3, Choice("int8", "uint8"), "matrix", hw)
    b = layer_cost(g32, Choice("int8", "uint8"), "matrix", hw)
    assert a.compute_cycles == pytest.approx(b.compute_cycles)
    assert a.compute_cycles == pytest.approx(3 * 64 * 10**4 * (32 / 3) / 4096)


def test_roofline_arithmetic_by_hand():
    """One layer worked out from the YAML's numbers (a2000: 4096 int8 MACs/cycle, 64 B/cycle, 200 overhead)."""
    hw = dal.load_hardware("a2000")
    g = LayerGeom("l", "linear", 64 * 128 * 256, 128 * 256, 64 * 256, 64 * 128, 256, 128)
    c = layer_cost(g, Choice("int8", "uint8"), "matrix", hw)
    assert c.compute_cycles == 64 * 128 * 256 / 4096
    assert c.bytes == 128 * 256 + 64 * 256 + 64 * 128
    assert c.memory_cycles == c.bytes / 64
    assert c.cycles == max(c.compute_cycles, c.memory_cycles) + 200
    s = layer_cost(g, Choice("int8", "uint8", sparse=True), "matrix", hw)
    assert s.weight_bytes == 128 * 256 / 2 * (8 + 2) / 8
