"""dal.save_checkpoint / load_checkpoint keep the hardware model itself, not only its name."""
import json

import pytest
import torch

import dal
from dal.prepare.state import set_quantizer_state
from dal.zoo import MnistCNN


def test_an_edited_bundled_hardware_model_comes_back_as_edited(tmp_path):
    hw = dal.load_hardware("a2000").to_dict()
    hw["requantizer"] = {"kind": "fixed_point", "multiplier_bits": 31, "rounding": "half_up"}  # same name
    x = torch.randn(2, 1, 28, 28)
    torch.manual_seed(0)
    m = dal.prepare_qat(MnistCNN(), "int8_balanced", hardware=hw, example_inputs=(x,))
    dal.calibrate(m, [x], progress=False)
    set_quantizer_state(m, "frozen")
    dal.save_checkpoint(m, tmp_path / "m.pt")
    back = dal.load_checkpoint(tmp_path / "m.pt", MnistCNN, example_inputs=(x,))
    hw = dal.prepared(back).hardware
    assert hw.name == "a2000" and hw.requantizer.kind == "fixed_point"
    proto = dal.export_onnx(back, (x,), str(tmp_path / "m.onnx"))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["dal.requantizer"])["kind"] == "fixed_point"
    with torch.no_grad():
        assert torch.equal(back(x), m.eval()(x))


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    from dal.zoo import MnistCNN

    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"junk\.pt is not a dal checkpoint: torch\.load cannot read it"):
        dal.load_checkpoint(junk, MnistCNN)
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), tensor)
    with pytest.raises(ValueError, match=r"tensor\.pt is not a dal checkpoint: it holds a Tensor"):
        dal.load_checkpoint(tensor, MnistCNN)
