"""dal.verify on a bad file or bad inputs: a clear error naming the file or the input and what would work."""
import numpy as np
import onnx
import pytest
import torch

import dal
from dal.prepare import set_quantizer_state
from dal.verification import VerifyInputError
from dal_examples.zoo import MnistCNN


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(path, QAT model) of MnistCNN exported with a fixed batch of 2, and a dynamic-batch twin."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [torch.randn(2, 1, 28, 28) for _ in range(2)], progress=False)
    set_quantizer_state(q, "frozen")
    root = tmp_path_factory.mktemp("verify-bad")
    dal.export_onnx(q, (x,), root / "fixed.onnx")
    dal.export_onnx(q, (x,), root / "dynamic.onnx", dynamic_batch=True)
    return root, q


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_a_truncated_file_is_named(exported, keep):
    root, q = exported
    data = (root / "fixed.onnx").read_bytes()
    bad = root / f"truncated_{keep}.onnx"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(VerifyInputError, match=r"truncated_.*\.onnx is not a (readable|valid) ONNX") as err:
        dal.verify(bad, q, (torch.randn(2, 1, 28, 28),))
    assert "dal.export_onnx" in str(err.value)  # what would work
    assert isinstance(err.value, ValueError)


def test_a_file_that_is_not_onnx_is_named(exported):
    root, q = exported
    bad = root / "notes.onnx"
    bad.write_text("hello\n")
    with pytest.raises(VerifyInputError, match="notes.onnx is not a"):
        dal.verify(bad, q, (torch.randn(2, 1, 28, 28),))


def test_a_missing_file_is_named(exported):
    root, q = exported
    with pytest.raises(FileNotFoundError, match="nope.onnx: no such file"):
        dal.verify(root / "nope.onnx", q, (torch.randn(2, 1, 28, 28),))


@pytest.mark.parametrize("shape,message", [
    ((4, 1, 28, 28), r"input 0 \('input'\) has shape \(4, 1, 28, 28\), but .*fixed.onnx takes \(2, 1, 28, 28\): "
                     r"dimension 0 must be 2 \(.*dynamic_batch=True"),
    ((2, 1, 32, 32), r"dimension 2 must be 28"),
    ((2, 28, 28), r"has shape \(2, 28, 28\) \(3-D\), but .* takes 4-D inputs"),
])
def test_an_input_of_the_wrong_shape_is_named(exported, shape, message):
    root, q = exported
    with pytest.raises(VerifyInputError, match=message):
        dal.verify(root / "fixed.onnx", q, (torch.randn(shape),))


def test_a_dynamic_batch_file_takes_any_batch_but_not_any_shape(exported):
    root, q = exported
    report = dal.verify(root / "dynamic.onnx", q, (torch.randn(3, 1, 28, 28),))
    assert report.outputs["output"]["npu_vs_torch"].elements == 30
    with pytest.raises(VerifyInputError, match=r"takes \(batch, 1, 28, 28\): dimension 1 must be 1"):
        dal.verify(root / "dynamic.onnx", q, (torch.randn(3, 2, 28, 28),))


def test_an_input_of_the_wrong_type_or_count_is_named(exported):
    root, q = exported
    with pytest.raises(VerifyInputError, match=r"input 0 \('input'\) is float64, but .* takes float32"):
        dal.verify(root / "fixed.onnx", None, (np.zeros((2, 1, 28, 28)),))
    x = torch.randn(2, 1, 28, 28)
    with pytest.raises(VerifyInputError, match=r"takes 1 input\(s\) \['input'\], got 2"):
        dal.verify(root / "fixed.onnx", q, (x, x))


def test_a_model_proto_is_checked_too(exported):
    root, q = exported
    proto = onnx.load(str(root / "fixed.onnx"))
    with pytest.raises(VerifyInputError, match="the model takes"):
        dal.verify(proto, q, (torch.randn(5, 1, 28, 28),))


def test_without_onnxruntime_the_extra_is_named(exported, monkeypatch):
    root, q = exported
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r"pip install 'dal\[ort\]'"):
        dal.verify(root / "fixed.onnx", q, (torch.randn(2, 1, 28, 28),))
    report = dal.verify(root / "fixed.onnx", q, (torch.randn(2, 1, 28, 28),), onnxruntime=False)
    assert list(report.outputs["output"]) == ["npu_vs_torch", "npu_vs_float"]
