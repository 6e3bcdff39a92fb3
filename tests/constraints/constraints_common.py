"""Helpers for the hardware-constraint tests (imported by name: a conftest module name is shared by
every test folder, so helpers do not live in conftest.py): the bundled pow2_int8 model with overrides, tiny
models, and export + onnxruntime (ORT_DISABLE_ALL) values."""
import json

import onnx
import torch
from torch import nn


def pow2_hw(**overrides) -> dict:
    """The bundled pow2_int8 hardware model as a dict, top-level keys replaced."""
    from dal.hardware import load_hardware
    d = load_hardware("pow2_int8").to_dict()
    d.update(overrides)
    return d


class CatNet(nn.Module):
    """Two convs concatenated (one through a ReLU), then a 1x1 conv: a shared-scale concat."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c(torch.cat([torch.relu(self.a(x)), self.b(x)], 1))


def export(model, x, path) -> onnx.ModelProto:
    import dal
    dal.export_onnx(model, (x,), str(path))
    return onnx.load(str(path))


def set_meta(model: onnx.ModelProto, key: str, value: dict) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for p in m.metadata_props:
        if p.key == key:
            p.value = json.dumps(value)
            return m
    m.metadata_props.append(onnx.StringStringEntryProto(key=key, value=json.dumps(value)))
    return m


def ort_all(model: onnx.ModelProto, feed: dict) -> dict:
    from oracles import ort_values
    return ort_values(model, feed)
