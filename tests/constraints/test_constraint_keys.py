"""The hardware-model keys of the chip's constraints: declared, validated with file and line."""
import pytest

from dal.hardware import HardwareModelError, load_hardware

BAD = """\
name: bad_pow2
engines:
  matrix: {formats: [int8, uint8, int16]}
accumulator_bits: 24
accumulator_overflow: clip
shared_scale: [cat, concat]
requantizer:
  kind: power_of_two
  multiplier_bits: 16
weight_rules:
  scale_constraint: pow2
activation_rules:
  scale_constraint: power_of_two
ops:
  conv: {engine: matrix, weight_formats: [int8], input_formats: [int16], output_formats: [int8]}
"""


def test_bundled_pow2_int8_declares_its_constraints():
    hw = load_hardware("pow2_int8")
    assert hw.requantizer.kind == "power_of_two" and hw.requantizer.multiplier_bits is None
    assert hw.weight_rules.scale_constraint == hw.activation_rules.scale_constraint == "power_of_two"
    assert hw.shared_scale == ("cat",)
    assert (hw.accumulator_bits, hw.accumulator_overflow, hw.channel_alignment) == (32, "saturate", 16)
    from dal.formats import INT16
    assert INT16 in hw.allowed_formats("conv", "input") and INT16 in hw.engine("dsp").formats
    assert load_hardware(hw.to_dict()) == hw  # the schema round-trips


def test_other_bundled_models_keep_their_defaults():
    for name in ("a1000", "a2000", "generic_int8"):
        hw = load_hardware(name)
        assert hw.weight_rules.scale_constraint == "any" and hw.shared_scale == ()
        assert hw.accumulator_overflow == "saturate"


def test_bad_values_are_named_with_file_and_line(tmp_path):
    path = tmp_path / "bad_pow2.yaml"
    path.write_text(BAD)
    with pytest.raises(HardwareModelError) as err:
        load_hardware(str(path))
    text = str(err.value)
    lines = {k: i + 1 for i, k in enumerate(BAD.splitlines())}
    where = lambda prefix: next(n for line, n in lines.items() if line.strip().startswith(prefix))
    assert f"{path}:{where('accumulator_overflow')}: accumulator_overflow: 'clip' is not allowed (allowed: saturate, wrap)" in text
    assert f"{path}:{where('scale_constraint: pow2')}: weight_rules.scale_constraint: 'pow2' is not allowed" in text
    assert f"{path}:{where('multiplier_bits')}: requantizer.multiplier_bits: a power_of_two requantizer only shifts" in text
    assert f"{path}:{where('shared_scale')}: shared_scale[1]: 'concat' is not allowed; did you mean 'cat'?" in text


def test_shift_requantizer_needs_power_of_two_scales(tmp_path):
    text = BAD.replace("accumulator_overflow: clip\n", "").replace("[cat, concat]", "[cat]").replace(
        "  multiplier_bits: 16\n", "").replace("scale_constraint: pow2", "scale_constraint: any")
    path = tmp_path / "any_scales.yaml"
    path.write_text(text)
    with pytest.raises(HardwareModelError) as err:
        load_hardware(str(path))
    line = text.splitlines().index("  kind: power_of_two") + 1
    assert f"{path}:{line}: requantizer.kind: a power_of_two (shift-only) requantizer needs scale_constraint: " \
           "power_of_two in both weight_rules and activation_rules" in str(err.value)
