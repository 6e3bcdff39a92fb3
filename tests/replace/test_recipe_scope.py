"""A recipe rule's own ``replace:`` list applies to the layers that rule matches (first match
decides), while the top-level ``replace:`` list applies to the whole model."""
import torch
from torch import nn

import dal


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))


def _recipe(scoped_rule: dict, top=()):
    rec = dal.load_recipe("int8_balanced").to_dict()
    rec["name"], rec["replace"] = "scoped", list(top)
    rec["rules"] = [scoped_rule] + rec["rules"]
    return rec


def test_rule_level_replace_only_touches_its_layers():
    x = torch.randn(2, 8)
    rule = {"match": "1", "input": {"format": "int8", "symmetric": False}, "replace": ["lut_activation"]}
    q = dal.prepare_qat(_model(), _recipe(rule), hardware="a2000", example_inputs=(x,))
    assert type(q[1]).__name__ == "QLutActivation"
    # the same function elsewhere, not matched by that recipe rule: the float GELU, an FP16 island
    # on the a2000 (its vector engine has compute: fp16)
    assert isinstance(q[3], nn.GELU) and type(q[3]).__name__ == "Fp16GELU"
    rows = dal.prepared(q).report.replacements.by_rule("lut_activation")
    assert [r.path for r in rows] == ["1"]


def test_top_level_replace_still_applies_everywhere():
    x = torch.randn(2, 8)
    rule = {"match": "1", "input": {"format": "int8", "symmetric": False}}
    q = dal.prepare_qat(_model(), _recipe(rule, top=["lut_activation"]), hardware="a2000", example_inputs=(x,))
    assert type(q[1]).__name__ == type(q[3]).__name__ == "QLutActivation"


def test_scoped_rule_that_matches_nothing_says_so():
    x = torch.randn(2, 8)
    rule = {"match": "0", "replace": ["lut_activation"]}  # a Linear: no activation to replace there
    q = dal.prepare_qat(_model(), _recipe(rule), hardware="a2000", example_inputs=(x,))
    assert "scope" in dal.prepared(q).report.replacements.unmatched["lut_activation"]
    assert isinstance(q[1], nn.GELU) and type(q[1]).__name__ == "Fp16GELU"  # not replaced (an FP16 island)
