"""Invalid hardware models: every problem reported at once with file, line, key and value."""
import textwrap

import pytest

from dal.hardware import (Engine, HardwareModel, HardwareModelError, OpSupport, Requantizer,
                          WeightRules, load_hardware)

GOOD = """\
name: tiny
engines:
  matrix: {formats: [int8, uint8]}
ops:
  conv: {engine: matrix, weight_formats: [int8], input_formats: [uint8], output_formats: [uint8]}
requantizer:
  kind: float
"""


def write(tmp_path, text, name="hw.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_at(err):
    return {(p.line, p.key) for p in err.value.problems}


def test_good_minimal_model(tmp_path):
    hw = load_hardware(write(tmp_path, GOOD))
    assert hw.name == "tiny" and hw.op("linear") is None
    assert hw.allowed_formats("linear", "weight") == ()


def test_unknown_keys_listed_at_once_with_lines(tmp_path):
    path = write(tmp_path, GOOD + "acumulator_bits: 32\nsparse_opz: []\n"
                 "weight_rules: {symmetric: true}\n")
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    assert problems_at(err) >= {(8, "acumulator_bits"), (9, "sparse_opz"), (10, "weight_rules.symmetric")}
    text = str(err.value)
    assert "hw.yaml:8" in text and "did you mean 'accumulator_bits'" in text
    assert "did you mean 'sparse_ops'" in text and "did you mean 'symmetric_required'" in text


def test_unknown_format_names_line_value_and_known(tmp_path):
    path = write(tmp_path, GOOD.replace("weight_formats: [int8]", "weight_formats: [int8, int3]"))
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    (p,) = err.value.problems
    assert p.line == 5 and p.key == "ops.conv.weight_formats[1]"
    assert "'int3'" in p.message and "fp8_e4m3" in p.message  # what is allowed


def test_wrong_types(tmp_path):
    path = write(tmp_path, GOOD + "accumulator_bits: '32'\nchannel_alignment: 0\nfp16_ops: 3.5\n")
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    keys = {p.key: p for p in err.value.problems}
    assert keys["accumulator_bits"].line == 8 and "expected an integer" in keys["accumulator_bits"].message
    assert keys["channel_alignment"].line == 9
    assert "fp16_ops" in {k.split("[")[0] for k in keys}


def test_semantic_errors_with_lines(tmp_path):
    path = write(tmp_path, """\
        name: tiny
        engines:
          matrix: {formats: [int8]}
        ops:
          conv: {engine: matrx, weight_formats: [int8], input_formats: [int8], output_formats: [int8]}
          add: {engine: matrix, input_formats: [uint8], output_formats: [int8]}
        sparse_ops: [linear]
        requantizer: {kind: fixed_point, rounding: half_up}
        """)
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    text = str(err.value)
    got = problems_at(err)
    assert (5, "ops.conv.engine") in got and "did you mean 'matrix'" in text
    assert (6, "ops.add.input_formats") in got and "not computed by the matrix engine" in text
    assert (7, "sparse_ops[0]") in got
    assert (8, "requantizer.multiplier_bits") in got


def test_roles_checked(tmp_path):
    path = write(tmp_path, GOOD + "  add: {engine: matrix, weight_formats: [int8], input_formats: [int8]}\n"
                 .replace("  add", "ops2"))  # keep GOOD intact; build a second file below
    text = GOOD.replace("requantizer:", "  add: {engine: matrix, weight_formats: [int8], input_formats: [int8]}\n"
                        "requantizer:")
    with pytest.raises(HardwareModelError) as err:
        load_hardware(write(tmp_path, text, "roles.yaml"))
    msgs = {p.key: p.message for p in err.value.problems}
    assert "add has no weight" in msgs["ops.add.weight_formats"]
    assert "list at least one format" in msgs["ops.add.output_formats"]
    del path


def test_syntax_error_is_hardware_model_error(tmp_path):
    path = write(tmp_path, "name: x\nengines: {matrix: {formats: [int8]}\nops: {}\n")
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    assert err.value.problems[0].source == str(path) and err.value.problems[0].line
    assert isinstance(err.value, ValueError)


def test_dataclasses_validate_on_construction():
    with pytest.raises(HardwareModelError, match="multiplier_bits"):
        Requantizer(kind="fixed_point")
    with pytest.raises(HardwareModelError, match="half_even"):
        Requantizer(kind="float", rounding="half_up")
    with pytest.raises(HardwareModelError, match="group_sizes"):
        WeightRules(granularities=("per_group",))
    with pytest.raises(HardwareModelError, match="has no weight"):
        OpSupport("matmul", "matrix", weight_formats=("int8",), input_formats=("int8",), output_formats=("int8",))
    op = OpSupport("linear", "m", ["int8"], ["int8"], ["int8"])  # names and lists are converted
    assert op.weight_formats[0].name == "int8" and isinstance(op.weight_formats, tuple)
    with pytest.raises(HardwareModelError, match="not defined"):
        HardwareModel("x", engines=(Engine("matrix", formats=("int8",)),), ops=(op,))
    hw = HardwareModel("x", engines=(Engine("m", formats=("int8",)),), ops=(op,))
    assert hw.op("linear") is op
    with pytest.raises(Exception):
        hw.name = "y"  # frozen


def test_dict_input_reports_keys_without_lines():
    with pytest.raises(HardwareModelError) as err:
        load_hardware({"name": "d", "engines": {}, "ops": {}, "requantiser": {}})
    (p,) = err.value.problems
    assert p.source == "<dict>" and p.line is None and "did you mean 'requantizer'" in p.message


def test_multiplier_bits_beyond_what_a_signed_int32_multiplier_holds_is_refused():
    """32 would be accepted here and refused only by dal.npu at verify time ([2, 31] there)."""
    Requantizer(kind="fixed_point", multiplier_bits=31)
    with pytest.raises(HardwareModelError, match="from 8 to 31; got 32"):
        Requantizer(kind="fixed_point", multiplier_bits=32)
