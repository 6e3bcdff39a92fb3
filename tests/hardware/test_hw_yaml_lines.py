"""Line-aware YAML loading: every key path keeps its line; syntax errors name file and line."""
import pytest

from dal.config.problems import ConfigError
from dal.config.yaml_lines import from_data, load_yaml_file, load_yaml_text


def test_lines_of_keys_and_items():
    doc = load_yaml_text("a:\n  b: 1\n  c:\n    - x\n    - {d: 2}\n", "f.yaml")
    assert doc.data == {"a": {"b": 1, "c": ["x", {"d": 2}]}}
    assert doc.line(("a",)) == 1
    assert doc.line(("a", "b")) == 2
    assert doc.line(("a", "c", 1)) == 5
    assert doc.line(("a", "c", 1, "d")) == 5
    assert doc.line(("a", "c", 1, "missing")) == 5  # nearest ancestor
    assert doc.where(("a", "b")) == "f.yaml:2"


def test_anchors_and_merge_keys():
    doc = load_yaml_text("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\n", "f.yaml")
    assert doc.data["other"] == {"x": 1, "y": 3}
    assert doc.line(("other", "y")) == 4


def test_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_file(path)
    p = err.value.problems[0]
    assert p.source == str(path) and p.line is not None and p.line >= 2
    assert "broken.yaml" in str(err.value) and "syntax" in str(err.value)


def test_duplicate_key_reported_with_both_lines():
    with pytest.raises(ConfigError) as err:
        load_yaml_text("a: 1\nb: 2\na: 3\n", "d.yaml")
    p = err.value.problems[0]
    assert p.line == 3 and "first at line 1" in p.message


def test_tab_indentation_is_a_syntax_error():
    with pytest.raises(ConfigError) as err:
        load_yaml_text("a:\n\tb: 1\n", "t.yaml")
    assert err.value.problems[0].line == 2


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_yaml_file(tmp_path / "nope.yaml")


def test_from_data_has_no_lines():
    doc = from_data({"a": 1})
    assert doc.line(("a",)) is None and doc.where(("a",)) == "<dict>"
