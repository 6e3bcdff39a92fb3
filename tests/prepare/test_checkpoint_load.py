"""dal.load_checkpoint without example_inputs, and into the wrong model.

The oracle is the trained model itself: a checkpoint loaded back must give its outputs bit for
bit (torch.equal) and its quantizers' state, whether or not the loader passes example_inputs.
"""
import dataclasses
import functools

import pytest
import torch
from torch import nn

import dal
from dal_examples.zoo import MnistCNN


def recipe() -> dict:
    """int8_balanced with output quantizers (the recipe key ``quantize_outputs``, where it exists)."""
    rec = dal.load_recipe("int8_balanced")
    out = rec.to_dict()
    if "quantize_outputs" in {f.name for f in dataclasses.fields(rec)}:
        out["quantize_outputs"] = True
    return out


def trained(tmp_path, factory=MnistCNN, x=None):
    torch.manual_seed(0)
    x = torch.randn(4, 1, 28, 28) if x is None else x
    model = dal.prepare_qat(factory(), recipe(), hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [x, torch.randn_like(x)], progress=False)
    dal.set_quantizer_state(model, "frozen")
    dal.save_checkpoint(model, tmp_path / "m.pt")
    return model.eval(), x


def test_loads_without_example_inputs_with_the_output_quantizer_recreated(tmp_path):
    model, x = trained(tmp_path)
    assert model.head.output_quant is not None  # added by prepare's example forward
    back = dal.load_checkpoint(tmp_path / "m.pt", MnistCNN)
    assert back.head.output_quant is not None
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_output_quantizers_of_the_file_are_recreated_when_this_prepare_adds_none(tmp_path):
    """A file written with output quantizers, loaded where the recipe no longer asks for them
    (``quantize_outputs: false``), with example_inputs: the file's quantizers come back."""
    if "quantize_outputs" not in {f.name for f in dataclasses.fields(dal.load_recipe("int8_balanced"))}:
        pytest.skip("this dal's Recipe has no quantize_outputs key: every prepare with example_inputs adds them")
    model, x = trained(tmp_path)
    ckpt = torch.load(tmp_path / "m.pt", weights_only=False)
    ckpt["recipe"]["quantize_outputs"] = False
    torch.save(ckpt, tmp_path / "m.pt")
    back = dal.load_checkpoint(tmp_path / "m.pt", MnistCNN, example_inputs=(x,))
    assert back.head.output_quant is not None
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_loading_into_another_model_names_the_class_that_wrote_it(tmp_path):
    trained(tmp_path)
    other = functools.partial(MnistCNN, num_classes=7)
    with pytest.raises(ValueError) as info:
        dal.load_checkpoint(tmp_path / "m.pt", other)
    msg = str(info.value)
    assert "written by a prepared MnistCNN (fingerprint " in msg
    assert "the model built, a dal_examples.zoo.MnistCNN (fingerprint " in msg and "model_factory" in msg
    assert "head.weight: checkpoint (10, 576), model (7, 576)" in msg


class Gated(nn.Module):
    """A forward torch.fx cannot trace: its ``+`` is found by call site in the example forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(1, 4, 3), nn.Conv2d(1, 4, 3), nn.Linear(4, 3)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 1e9:  # data-dependent: not traceable
            y = -y
        return self.head((y + self.b(x)).mean((2, 3)))


def test_what_only_the_example_forward_decides_names_example_inputs(tmp_path):
    model, x = trained(tmp_path, Gated, torch.randn(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"pass example_inputs=\(x,\)"):
        dal.load_checkpoint(tmp_path / "m.pt", Gated)
    back = dal.load_checkpoint(tmp_path / "m.pt", Gated, example_inputs=(x,))
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
