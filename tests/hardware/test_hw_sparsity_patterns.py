"""A hardware model's sparsity_patterns are checked at load by the one N:M rule (dal.config).

The range is what dal.sparsity applies (1 <= N < M <= 16): a model that lists a pattern the
sparsity code refuses fails at load with file, line and key, not later inside prepare.
"""
import textwrap

import pytest

from dal.hardware import HardwareModel, HardwareModelError, load_hardware

BASE = """\
name: tiny
engines:
  matrix: {formats: [int8, uint8]}
ops:
  conv: {engine: matrix, weight_formats: [int8], input_formats: [uint8], output_formats: [uint8]}
sparse_ops: [conv]
"""


def write(tmp_path, text):
    path = tmp_path / "hw.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_unsupported_pattern_fails_at_load_with_file_line_and_key(tmp_path):
    path = write(tmp_path, BASE + 'sparsity_patterns:\n  - "2:4"\n  - "1:32"\n')
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    (p,) = err.value.problems
    assert (p.source, p.line, p.key) == (str(path), 9, "sparsity_patterns[1]")
    assert f"{path}:9: sparsity_patterns[1]:" in str(err.value)
    assert "'1:32'" in p.message and "16" in p.message


@pytest.mark.parametrize("bad", ["0:4", "4:4", "4:2", "2:4:8", "17:32"])
def test_other_bad_patterns(tmp_path, bad):
    path = write(tmp_path, BASE + f'sparsity_patterns: ["{bad}"]\n')
    with pytest.raises(HardwareModelError) as err:
        load_hardware(path)
    (p,) = err.value.problems
    assert p.line == 7 and p.key == "sparsity_patterns[0]" and "N:M" in p.message


def test_unquoted_pattern_says_quote_it(tmp_path):
    with pytest.raises(HardwareModelError) as err:
        load_hardware(write(tmp_path, BASE + "sparsity_patterns: [2:4]\n"))
    (p,) = err.value.problems
    assert p.line == 7 and "quotes" in p.message


def test_patterns_are_canonical_and_compared_as_patterns(tmp_path):
    hw = load_hardware(write(tmp_path, BASE + 'sparsity_patterns: [" 2 : 4", "1:4"]\n'))
    assert hw.sparsity_patterns == ("2:4", "1:4")
    assert hw.supports_sparsity("conv", "2:4") and hw.supports_sparsity("conv", "2 :4")
    assert not hw.supports_sparsity("conv", "4:8") and not hw.supports_sparsity("conv", "1:32")
    assert not hw.supports_sparsity("linear", "2:4")


def test_constructor_refuses_what_the_loader_refuses():
    with pytest.raises(HardwareModelError, match="1:32"):
        HardwareModel(name="x", sparsity_patterns=("1:32",))
