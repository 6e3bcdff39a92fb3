"""Malformed recipes: unknown keys (all, with suggestions), bad values, YAML syntax; file:line."""
import textwrap

import pytest

from dal.recipe import LayerSpec, RecipeError, Rule, TensorSpec, load_recipe


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def by_key(err):
    return {p.key: p for p in err.value.problems}


def test_unknown_keys_all_listed_with_line_and_suggestion(tmp_path):
    path = write(tmp_path, """\
        name: x
        calibraton: {method: kl}
        rules:
          - match: "features.*"
            weight: {format: int8, granularty: per_channel}
            input: {format: uint8, symetric: true}
          - type: conv
            wieght: int8
        """)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    p = by_key(err)
    assert p["calibraton"].line == 2 and "did you mean 'calibration'" in p["calibraton"].message
    assert p["rules[0].weight.granularty"].line == 5
    assert "did you mean 'granularity'" in p["rules[0].weight.granularty"].message
    assert p["rules[0].input.symetric"].line == 6
    assert p["rules[1].wieght"].line == 8 and "did you mean 'weight'" in p["rules[1].wieght"].message
    text = str(err.value)
    assert "4 problems" in text and f"{path}:8" in text


def test_malformed_yaml_has_line(tmp_path):
    path = write(tmp_path, """\
        name: x
        rules:
          - match: "a"
            weight: {format: int8
          - match: b
        """)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    (p,) = err.value.problems
    assert p.source == str(path) and p.line in (4, 5) and "syntax" in p.message


def test_wrong_types_and_values(tmp_path):
    path = write(tmp_path, """\
        name: x
        calibration: {method: entropy, num_batches: many}
        rules:
          - match: 3
            weight: {format: int3}
          - type: conv
            input: {format: int8, granularity: per_row, symmetric: "yes", group_size: 0}
          - match: a
            fallback: fp32
          - match: b
            sparsity: "4:2"
          - match: 're:layer(\\d+'
            skip: true
          - "not a mapping"
        """)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    p = by_key(err)
    assert "did you mean 'kl'" not in p["calibration.method"].message  # lists what is allowed
    assert "easyquant" in p["calibration.method"].message and p["calibration.method"].line == 2
    assert "expected an integer" in p["calibration.num_batches"].message
    assert p["rules[0].match[0]"].line == 4
    assert "'int3'" in p["rules[0].weight.format"].message and p["rules[0].weight.format"].line == 5
    assert "per_row" in p["rules[1].input.granularity"].message
    assert "expected true or false" in p["rules[1].input.symmetric"].message
    assert "fp16" in p["rules[2].fallback"].message and p["rules[2].fallback"].line == 9
    assert "N:M" in p["rules[3].sparsity"].message
    assert "regular expression" in p["rules[4].match[0]"].message and p["rules[4].match[0]"].line == 12
    assert p["rules[5]"].line == 14


def test_spec_consistency_errors(tmp_path):
    path = write(tmp_path, """\
        rules:
          - match: a
            weight: {format: int8, granularity: per_group}
          - match: b
            input: {format: fp8_e4m3, symmetric: false}
          - match: c
            weight: {format: int4, group_size: 32}
          - match: d
            weight: int8
            fallback: fp16
          - match: e
            skip: true
            sparsity: "2:4"
          - match: f
        """)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    p = by_key(err)
    assert "group_size" in p["rules[0].weight.group_size"].message and p["rules[0].weight.group_size"].line == 3
    assert "no zero point" in p["rules[1].input.symmetric"].message
    assert "per_group" in p["rules[2].weight.group_size"].message
    assert p["rules[3].fallback"].line == 10
    assert p["rules[4].skip"].line == 12
    assert "asks for nothing" in p["rules[5]"].message and p["rules[5]"].line == 14


def test_missing_rules_and_bad_top_level(tmp_path):
    with pytest.raises(RecipeError, match="missing required key 'rules'"):
        load_recipe(write(tmp_path, "name: x\n"))
    with pytest.raises(RecipeError, match="expected a mapping"):
        load_recipe(write(tmp_path, "- a\n", "list.yaml"))
    with pytest.raises(RecipeError, match="not a bundled recipe.*did you mean 'int8_balanced'"):
        load_recipe("int8_balance")


def test_dict_errors_name_key():
    with pytest.raises(RecipeError) as err:
        load_recipe({"rules": [{"match": "*", "weigth": "int8"}]})
    (p,) = err.value.problems
    assert p.source == "<dict>" and p.key == "rules[0].weigth" and "did you mean 'weight'" in p.message


def test_dataclasses_validate_on_construction():
    with pytest.raises(RecipeError, match="observer"):
        TensorSpec("fp16", observer="minmax")
    with pytest.raises(RecipeError, match="narrow_range"):
        TensorSpec("fp8_e4m3", symmetric=True, narrow_range=True)
    spec = TensorSpec("int8", observer_args={"b": 2, "a": 1})
    assert spec.format.name == "int8" and spec.observer_args == (("a", 1), ("b", 2))
    with pytest.raises(RecipeError, match="FP16"):
        LayerSpec(weight=spec, fallback_fp16=True)
    with pytest.raises(RecipeError, match="skip"):
        Rule(match="a", skip=True, weight=spec)
    with pytest.raises(Exception):
        spec.format = None  # frozen
