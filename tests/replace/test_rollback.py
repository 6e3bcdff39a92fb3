"""A replacement that breaks the forward (raises, or turns finite outputs into NaN) is reported by
rule and path, and every swap is undone."""
import pytest
import torch
from torch import nn

from dal.replace import auto_replace, rule


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))


@rule("test_wrong_shape")
class _WrongShape:
    def match(self, module, name):
        return isinstance(module, nn.Tanh)

    def build(self, module, hardware):
        return nn.Linear(3, 3)  # builds fine, fails in the forward


@rule("test_nan_gelu")
class _NanGelu:
    def match(self, module, name):
        return isinstance(module, nn.GELU)

    def build(self, module, hardware):
        class Nan(nn.Module):
            def forward(self, x):
                return x * float("nan")
        return Nan()


@pytest.mark.parametrize("rules,path,why", [
    (["test_nan_gelu", "test_wrong_shape"], "2.1", "forward on the example inputs raised RuntimeError"),
    (["test_nan_gelu"], "1", "not finite"),
])
def test_broken_replacement_is_named_and_undone(rules, path, why):
    m = _model()
    x = torch.randn(5, 4)
    with torch.no_grad():
        ref = m(x)
    originals = [type(mod) for mod in m.modules()]
    rep = auto_replace(m, rules, example_inputs=(x,))
    assert not rep.applied
    assert any(f.path == path and why in f.error for f in rep.failed), rep.failed
    assert [type(mod) for mod in m.modules()] == originals
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    with pytest.raises(RuntimeError, match=path.replace(".", r"\.")):
        auto_replace(_model(), rules, example_inputs=(x,), strict=True)


def test_example_inputs_the_original_cannot_take_are_named():
    with pytest.raises(ValueError, match=r"fails on example_inputs \(shapes \[\(5, 3\)\]\) before any replacement"):
        auto_replace(_model(), ["test_nan_gelu"], example_inputs=(torch.randn(5, 3),))
