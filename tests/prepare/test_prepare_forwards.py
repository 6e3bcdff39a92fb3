"""How many forwards of the model prepare_qat makes (issue 41: at most 2 with example inputs; it
makes one: the float forward before apply checks the inputs, finds the call sites and records
which modules run and which produce the outputs, dal.prepare.example_run).

Counted by the test, not by dal: the model's first module is a probe that counts its calls
(a parameterless user module with nothing to quantize, so prepare keeps the same object)."""
import pytest
import torch
from torch import nn

import dal
from dal_examples.zoo import MnistCNN


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        # prepare's activation recogniser (dal.prepare.whole_modules) also runs a parameterless
        # module alone, on a (1, 1, N) ramp: that is no forward of the model
        self.calls += x.dim() == 4
        return x


class Untraceable(nn.Module):
    """A forward torch.fx cannot trace (a branch on a tensor's value): its + is found by call site."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        if y.abs().sum() >= 0:
            y = y + self.conv2(y)
        return y


@pytest.mark.parametrize("make", [MnistCNN, Untraceable], ids=["traceable", "untraceable"])
@pytest.mark.parametrize("with_inputs", [True, False], ids=["example_inputs", "none"])
def test_prepare_makes_at_most_two_forwards(make, with_inputs):
    probe = Probe()
    model = nn.Sequential(probe, make())
    x = torch.randn(2, 1, 28, 28)
    q = dal.prepare_qat(model, "int8_balanced", hardware="a2000", example_inputs=(x,) if with_inputs else None)
    assert any(m is probe for m in q.modules())
    assert probe.calls == (1 if with_inputs else 0)
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    if make is Untraceable and with_inputs:  # the one forward before apply also found the call site
        assert [r.status for n, r in rows.items() if ".dal_sites.add" in n] == ["quantized"]
    q.eval()
    probe.calls = 0
    with torch.no_grad():
        q(x)
    assert probe.calls == 1


def test_bad_example_inputs_are_named_when_the_forward_is_the_call_site_discovery():
    model = Untraceable()
    with pytest.raises(ValueError, match=r"float model fails on example_inputs \[\(2, 3, 28, 28\)\] "
                                         r"\(nothing was changed\)"):
        dal.prepare_qat(model, "int8_balanced", hardware="a2000", example_inputs=(torch.randn(2, 3, 28, 28),))
    assert type(model.conv1) is nn.Conv2d


@pytest.mark.parametrize("make", [MnistCNN, Untraceable], ids=["traceable", "untraceable"])
def test_operator_replacement_forward_is_the_record(make):
    """A ``replace:`` recipe: replacement checks its swaps with a forward before and one after
    them; the second is prepare's recorded float forward (dal.capture), so a traceable model
    makes two forwards, and one fx cannot trace a third (the call-site discovery). The record
    still decides: the output producer gets its output quantizer."""
    from dal.recipe import load_recipe

    probe = Probe()
    model = nn.Sequential(probe, make(), nn.Hardswish())  # lut_activation replaces the Hardswish
    x = torch.randn(2, 1, 28, 28)
    recipe = {**load_recipe("int8_balanced").to_dict(), "replace": ["lut_activation"], "name": "int8+lut"}
    q = dal.prepare_qat(model, recipe, hardware="a2000", example_inputs=(x,), quantize_outputs=True)
    handle = dal.prepared(q)
    assert handle.report.replacements.replacements, "the rule replaced something"
    assert probe.calls == (2 if make is MnistCNN else 3)
    assert any(e.kind == "module" and e.path == "2" for e in handle.calls)
    assert handle.actions.outputs.paths
