"""dal.save_checkpoint / load_checkpoint keep the hardware model itself, not only its name."""
import json

import pytest
import torch

import dal
from dal.prepare.state import set_quantizer_state
from dal_examples.zoo import MnistCNN


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
    from dal_examples.zoo import MnistCNN

    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"junk\.pt is not a dal checkpoint: torch\.load cannot read it"):
        dal.load_checkpoint(junk, MnistCNN)
    tensor = tmp_path / "tensor.pt"
    torch.save(torch.zeros(3), tensor)
    with pytest.raises(ValueError, match=r"tensor\.pt is not a dal checkpoint: it holds a Tensor"):
        dal.load_checkpoint(tensor, MnistCNN)


def test_a_prepared_model_with_fp16_islands_pickles_whole_and_trains_the_same(tmp_path):
    """torch.save(model) of a prepared MobileNetV3 (its Hardswish / Hardsigmoid / pooling FP16
    islands have classes made at prepare time) loads back to the same classes and trains the
    same step, bit for bit."""
    import torchvision

    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 7])
    m = dal.prepare_qat(torchvision.models.mobilenet_v3_small(num_classes=10), "int8_balanced", hardware="a2000",
                        example_inputs=(x,))
    dal.calibrate(m, [x], progress=False)
    islands = {n: type(q) for n, q in m.named_modules() if type(q).__name__.startswith("Fp16")}
    assert {"Fp16Hardswish", "Fp16Hardsigmoid"} <= {c.__name__ for c in islands.values()}
    torch.save(m, tmp_path / "whole.pt")
    back = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert {n: type(q) for n, q in back.named_modules() if n in islands} == islands
    grads = []
    for model in (m, back):
        model.train()
        torch.manual_seed(1)  # the classifier's dropout
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and len(grads[0]) == len(list(m.parameters()))
