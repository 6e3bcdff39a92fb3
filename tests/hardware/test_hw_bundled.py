"""The bundled hardware models load, say what the brief says, and round-trip through to_dict."""
from pathlib import Path

import pytest

from dal.config.bundled import find_bundled
from dal.formats.qformat import get_format
from dal.hardware import HardwareModel, OP_CLASSES, list_hardware, load_hardware

BUNDLED = ("a1000", "a2000", "generic_int8")


def names(formats):
    return {f.name for f in formats}


def test_bundled_names():
    assert set(BUNDLED) <= set(list_hardware())


@pytest.mark.parametrize("name", BUNDLED)
def test_loads_and_round_trips(name):
    hw = load_hardware(name)
    assert isinstance(hw, HardwareModel) and hw.name == name
    assert hw.source == str(find_bundled("hardware_models", name)) and Path(hw.source).is_file()  # openable
    assert load_hardware(hw.to_dict()) == hw
    assert load_hardware(hw) is hw
    assert load_hardware(name.upper()) == hw
    assert hw.accumulator_bits == 32
    for op_class in OP_CLASSES:  # every op class is described by every bundled model
        assert hw.supports_op(op_class), op_class


def test_a1000_is_int8_only_fixed_point():
    hw = load_hardware("a1000")
    assert names(hw.allowed_formats("conv", "weight")) == {"int8"}
    assert names(hw.allowed_formats("conv", "input")) == {"int8", "uint8"}
    assert hw.requantizer.kind == "fixed_point"
    assert hw.requantizer.multiplier_bits == 31 and hw.requantizer.rounding == "half_up"
    assert hw.resize_modes == ("nearest",)
    assert not hw.supports_sparsity("conv")
    assert hw.weight_rules.symmetric_required
    assert hw.lut_size == 256 and "gelu" in hw.lut_ops
    for op in hw.ops:
        for role in op.roles:
            assert not any(f.is_float8 or f.bits == 4 or f.name == "fp16" for f in op.formats(role))


def test_a2000_capabilities():
    hw = load_hardware("a2000")
    w = names(hw.allowed_formats("linear", "weight"))
    assert {"int4", "int8", "fp8_e4m3", "fp8_e5m2", "fp16"} <= w
    assert {"uint8", "int8", "fp8_e4m3", "fp8_e5m2", "fp16"} <= names(hw.allowed_formats("matmul", "input"))
    assert names(hw.allowed_formats("softmax", "input")) == {"fp16"}
    assert hw.op("softmax").engine == "vector" and hw.op("conv").engine == "matrix"
    for op_class in ("conv", "linear", "matmul"):
        assert hw.supports_sparsity(op_class, "2:4")
    assert not hw.supports_sparsity("add") and not hw.supports_sparsity("conv", "1:4")
    assert hw.requantizer.kind == "float"
    assert "per_group" in hw.weight_rules.granularities and 32 in hw.weight_rules.group_sizes
    assert hw.runs_in_fp16("gelu") and hw.runs_in_fp16("softmax")
    assert "npu_attention" in hw.replace_rules_needed
    assert hw.channel_alignment == 32


def test_generic_int8():
    hw = load_hardware("generic_int8")
    assert hw.requantizer.kind == "float"
    assert not hw.weight_rules.symmetric_required
    assert get_format("int4") not in hw.allowed_formats("conv", "weight")


def test_embedding_has_no_input_role():
    op = load_hardware("a2000").op("embedding")
    assert op.roles == ("weight", "output") and op.input_formats == ()


def test_weight_rule_violations_say_what_is_allowed():
    rules = load_hardware("a2000").weight_rules
    assert rules.violations("per_channel", None, True, False) == []
    (msg,) = rules.violations("per_group", 16, True, False)
    assert "16" in msg and "32, 64, 128" in msg
    assert any("symmetric" in m for m in rules.violations("per_tensor", None, False, False))
    a1000 = load_hardware("a1000").weight_rules
    assert any("per_group" in m for m in a1000.violations("per_group", 32, True, False))


def test_unknown_bundled_name_lists_bundled():
    from dal.hardware import HardwareModelError

    with pytest.raises(HardwareModelError, match="a1000, a2000") as err:
        load_hardware("a200")
    assert "did you mean 'a2000'" in str(err.value)
    with pytest.raises(HardwareModelError, match="does not exist"):
        load_hardware("nowhere/x.yaml")
    with pytest.raises(HardwareModelError):
        load_hardware(42)
