"""``dal verify --json``: the report as one strict JSON document on stdout, the same verdict and rows
dal.verify gives for the same file, model and input (the input --random-input --seed draws)."""
import json

import torch

import dal
from dal.checkpoint import load_checkpoint
from dal.cli import main

SHAPE = (4, 1, 28, 28)


def test_verify_json_is_the_report(mnist_checkpoint, mnist_onnx, capsys):
    argv = ["verify", str(mnist_onnx), "--random-input", ",".join(map(str, SHAPE)), "--seed", "3",
            "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(mnist_checkpoint), "--json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads(out, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # NaN / Infinity refused
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    model = load_checkpoint(mnist_checkpoint, "dal_examples.zoo:MnistCNN", example_inputs=(x,))
    report = dal.verify(str(mnist_onnx), model, (x,))
    want = report.to_dict()
    assert doc["verdict"] is report.verdict() is True
    assert doc["verdict_line"] == want["verdict_line"]
    assert [r["tensor"] for r in doc["layers_forced"]] == [r.tensor for r in report.layers_forced]
    assert [r["differ"] for r in doc["torch_layers"]] == [r.differ for r in report.torch_layers]
    assert doc["integer"]["identical"] is True and set(doc["outputs"]) == set(report.outputs)
    assert not out.lstrip().startswith("dal.verify:")  # no text report around the JSON
