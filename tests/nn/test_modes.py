"""eval_mode restores each module's own training flag (model.train(flag) would set them all)."""
import torch
from torch import nn

import dal
from dal.nn.modes import eval_mode
from dal_examples.zoo import MnistCNN


def _flags(model):
    return {path: m.training for path, m in model.named_modules()}


def test_each_flag_comes_back_including_modules_swapped_in_the_block():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Dropout(), nn.Linear(4, 2))).train()
    model[1].eval()  # a frozen BN inside a training model
    before = _flags(model)
    with eval_mode(model):
        assert not any(_flags(model).values())
        model[2][1] = nn.Linear(4, 2).eval()            # replaced at a recorded path
        model[2].add_module("extra", nn.ReLU().eval())  # new path: its parent's flag
    after = _flags(model)
    assert after.pop("2.extra") is True
    assert after == before


def test_calibrate_verify_and_prepare_leave_a_frozen_submodule_frozen(tmp_path):
    x = torch.randn(4, 1, 28, 28)
    float_model = MnistCNN().train()
    float_model.head.eval()
    q = dal.prepare_qat(float_model, "int8_balanced", hardware="a2000", example_inputs=(x,))
    assert q.training and not q.get_submodule("head").training  # prepare ran its forwards in eval
    before = _flags(q)
    dal.calibrate(q, [torch.randn(4, 1, 28, 28) for _ in range(2)], progress=False)
    assert _flags(q) == before
    dal.set_quantizer_state(q, "frozen")
    dal.export_onnx(q, (x,), str(tmp_path / "m.onnx"))
    dal.verify(str(tmp_path / "m.onnx"), q, (x,), onnxruntime=False)
    assert _flags(q) == before
