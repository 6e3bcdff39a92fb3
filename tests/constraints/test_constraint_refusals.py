"""Bad input on power-of-two hardware: a recipe asking for per-channel activations, or a fixed
scale that is not 2^k, is refused with the recipe file and line, the layer and what is allowed."""
import pytest
import torch
from torch import nn

import dal
from dal.recipe import RecipeError

HEAD = """\
name: bad_for_pow2
rules:
  - type: conv
    weight: {format: int8, granularity: per_channel, symmetric: true, observer: minmax}
"""


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x)


def _refusal(tmp_path, input_line: str) -> tuple[str, str, int]:
    path = tmp_path / "bad_for_pow2.yaml"
    path.write_text(HEAD + input_line)
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(Two(), recipe=str(path), hardware="pow2_int8", example_inputs=(torch.randn(1, 3, 8, 8),))
    return str(err.value), str(path), HEAD.count("\n") - 1  # the rule's line: "  - type: conv"


def test_per_channel_activations_are_refused(tmp_path):
    text, path, line = _refusal(tmp_path, "    input: {format: uint8, granularity: per_channel, symmetric: false, "
                                          "observer: minmax}\n")
    assert f"{path}:{line}: rules[0].input: layer 'conv' (Conv2d, op class conv): input uint8: activation " \
           "granularity per_channel is not supported (allowed: per_tensor) by hardware 'pow2_int8'" in text


def test_a_fixed_scale_that_is_not_a_power_of_two_is_refused(tmp_path):
    text, path, line = _refusal(tmp_path, "    input: {format: uint8, symmetric: false, observer: minmax, "
                                          "observer_args: {fixed_scale: 0.1}}\n")
    assert f"{path}:{line}: rules[0].input.observer_args: layer 'conv' (Conv2d): input uint8: fixed_scale 0.1 " \
           "is not a power of two; allowed: a scale 2^k such as 0.0625 (2^-4) or 0.125 (2^-3)" in text
    assert "scale_constraint: power_of_two" in text


def test_a_power_of_two_fixed_scale_is_kept(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(HEAD + "    input: {format: uint8, symmetric: false, observer: minmax, "
                           "observer_args: {fixed_scale: 0.125}}\n")
    x = torch.randn(1, 3, 8, 8)
    m = dal.prepare_qat(Two(), recipe=str(path), hardware="pow2_int8", example_inputs=(x,))
    dal.calibrate(m, [(x,)], progress=False)
    assert float(m.conv.input_quant.scale) == 0.125
