"""prepare_qat's example_inputs: a list works like a tuple; inputs the float model cannot take are
named before anything is changed."""
import pytest
import torch

import dal
from dal_examples.zoo import MnistCNN


def test_wrong_example_input_is_named_and_the_model_left_alone():
    m = MnistCNN()
    before = [type(mod) for mod in m.modules()]
    with pytest.raises(ValueError, match=r"float model fails on example_inputs \[\(2, 3, 28, 28\)\] \(nothing was changed\)"):
        dal.prepare_qat(m, "int8_balanced", hardware="a2000", example_inputs=(torch.randn(2, 3, 28, 28),))
    assert [type(mod) for mod in m.modules()] == before


def test_a_list_of_example_inputs_is_a_tuple():
    x = torch.randn(2, 1, 28, 28)
    a = dal.prepare_qat(MnistCNN(), "int8_balanced", hardware="a2000", example_inputs=[x], quantize_outputs=True)
    assert "output quantizer added to head" in "\n".join(dal.prepared(a).report.notes)
