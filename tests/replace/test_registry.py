"""The rule registry and auto_replace's contract: unknown names, rules matching nothing, user rules,
failing builds (transactional), hardware defaults, the report."""
import pytest
import torch
from torch import nn

import dal
from dal.replace import RULES, auto_replace, known_rules, rule


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def test_builtin_rules_are_known():
    assert {"npu_attention", "lut_activation", "layernorm_fp16", "conv_bn_relu", "upsample_nearest"} <= set(known_rules())


def test_unknown_rule_lists_known_rules():
    with pytest.raises(ValueError) as err:
        auto_replace(_model(), ["npu_atention", "nope"])
    msg = str(err.value)
    assert "'npu_atention' (did you mean 'npu_attention'?)" in msg and "'nope'" in msg
    for name in known_rules():
        assert name in msg


def test_rule_that_matches_nothing_is_reported_by_name():
    rep = auto_replace(_model(), ["npu_attention", "layernorm_fp16"])
    assert set(rep.unmatched) == {"npu_attention", "layernorm_fp16"}
    assert "npu_attention: matched nothing" in rep.summary()


def test_hardware_reasons_when_nothing_matches():
    rep = auto_replace(nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear")), ["upsample_nearest"], "a2000")
    assert "a2000" in rep.unmatched["upsample_nearest"]


def test_user_rule_replaces_and_reports_drift():
    @rule("test_gelu_to_tanh_gelu")
    class GeluTanh:
        def match(self, module, name):
            return isinstance(module, nn.GELU)

        def build(self, module, hardware):
            return nn.GELU(approximate="tanh")

    try:
        m = _model()
        x = torch.randn(16, 4)
        rep = auto_replace(m, ["test_gelu_to_tanh_gelu"], example_inputs=(x,))
        assert isinstance(m[1], nn.GELU) and m[1].approximate == "tanh"
        (row,) = rep.replacements
        assert row.path == "1" and row.rule == "test_gelu_to_tanh_gelu"
        assert 0.999 < row.cosine <= 1.0 + 1e-12 and 0 < row.max_abs < 1e-2
    finally:
        RULES.pop("test_gelu_to_tanh_gelu")


def test_failing_user_build_leaves_model_intact():
    @rule("test_broken")
    class Broken:
        def match(self, module, name):
            return isinstance(module, nn.Linear)

        def build(self, module, hardware):
            raise RuntimeError("cannot build this")

    try:
        m = _model()
        before = [type(c) for c in m]
        rep = auto_replace(m, ["lut_activation", "test_broken"])  # lut_activation alone would succeed
        assert [type(c) for c in m] == before
        assert not rep.applied
        assert {f.rule for f in rep.failed} == {"test_broken"} and "cannot build this" in rep.failed[0].error
        assert "test_broken: FAILED" in rep.summary()
        with pytest.raises(RuntimeError, match="test_broken"):
            auto_replace(m, ["test_broken"], strict=True)
    finally:
        RULES.pop("test_broken")


def test_rule_without_build_is_refused():
    with pytest.raises(TypeError, match="build"):
        @rule("test_incomplete")
        class Incomplete:
            def match(self, module, name):
                return False
    assert "test_incomplete" not in RULES


def test_hardware_default_rules():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    rep = auto_replace(m, hardware="a2000")  # replace_rules_needed: [npu_attention, layernorm_fp16]
    assert rep.rules == ["npu_attention", "layernorm_fp16"]
    assert type(m[1]).__name__ == "Fp16LayerNorm"


def test_lut_only_for_hardware_lut_ops():
    m = nn.Sequential(nn.ELU(), nn.GELU(), nn.SiLU())
    auto_replace(m, ["lut_activation"], "a1000")
    assert type(m[0]) is nn.ELU and [type(c).__name__ for c in m[1:]] == ["LutActivation"] * 2


def test_prepare_report_carries_replacements():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    rec = {"name": "r", "replace": ["lut_activation", "npu_attention"],
           "rules": [{"type": ["linear", "activation"], "weight": "int8", "input": "uint8"}]}
    q = dal.prepare_qat(m, rec, hardware="a2000", example_inputs=(torch.randn(2, 4),))
    rep = dal.prepared(q).report.replacements
    assert rep.by_rule("lut_activation")[0].path == "1" and "npu_attention" in rep.unmatched
    assert any("operator replacement" in n for n in dal.prepared(q).report.notes)


def test_overriding_a_builtin_before_first_use_sticks():
    """Registering a built-in's name replaces it even when no built-in was loaded yet (a fresh
    process): the built-ins load first, then the user's rule."""
    import subprocess
    import sys

    code = ("import dal.replace as r\n"
            "@r.rule('lut_activation')\n"
            "class Mine:\n"
            "    def match(self, m, n): return False\n"
            "    def build(self, m, h): return m\n"
            "from dal.replace.registry import RULES\n"
            "print(type(RULES['lut_activation']).__name__, 'npu_attention' in r.known_rules())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Mine", "True"]
