"""``engines.<name>.compute``: an engine's internal float precision (fp32 default, fp16)."""
import textwrap

import pytest

from dal.hardware import Engine, HardwareModelError, load_hardware

YAML = """\
name: tiny
engines:
  matrix: {formats: [int8, uint8]}
  vector:
    formats: [int8, uint8, fp16]
    compute: {compute}
ops:
  conv: {{engine: matrix, weight_formats: [int8], input_formats: [uint8], output_formats: [uint8]}}
  activation: {{engine: vector, input_formats: [uint8], output_formats: [uint8]}}
"""


def _write(tmp_path, compute):
    path = tmp_path / "hw.yaml"
    path.write_text(textwrap.dedent(YAML.replace("{compute}", compute).replace("{{", "{").replace("}}", "}")))
    return path


def test_default_is_fp32_and_fp16_is_read(tmp_path):
    hw = load_hardware(_write(tmp_path, "fp16"))
    assert hw.engine("vector").compute == "fp16" and hw.engine("matrix").compute == "fp32"
    assert hw.compute_precision("activation") == "fp16" and hw.compute_precision("conv") == "fp32"
    assert hw.compute_precision("softmax") == "fp32"  # not run by this hardware
    assert load_hardware(hw.to_dict()) == hw
    assert "compute" not in hw.to_dict()["engines"]["matrix"]  # the default is not written out


def test_bundled_models_declare_what_their_descriptions_say():
    a2000 = load_hardware("a2000")
    assert "vector engine computes in fp16" in " ".join(a2000.description.split())
    assert a2000.engine("vector").compute == "fp16"
    assert {e.name: e.compute for e in a2000.engines if e.name != "vector"} == {"matrix": "fp32", "dsp": "fp32"}
    for name in ("a1000", "generic_int8", "pow2_int8"):
        assert {e.compute for e in load_hardware(name).engines} == {"fp32"}, name


def test_bad_value_is_refused_with_file_line_and_what_is_allowed(tmp_path):
    path = _write(tmp_path, "fp8")
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    (p,) = err.value.problems
    assert (p.line, p.key) == (6, "engines.vector.compute")
    text = str(err.value)
    assert f"{path}:6: engines.vector.compute: 'fp8' is not allowed (allowed: fp32, fp16)" in text, text


def test_fp16_compute_needs_fp16_in_the_engine_formats(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text(textwrap.dedent(YAML.replace("[int8, uint8, fp16]", "[int8, uint8]")
                                    .replace("{compute}", "fp16").replace("{{", "{").replace("}}", "}")))
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    assert "engines.vector.compute: compute: fp16 needs fp16 in the engine's formats" in str(err.value)
    with pytest.raises(HardwareModelError, match="not allowed"):
        Engine("v", formats=("int8",), compute="bf16")
