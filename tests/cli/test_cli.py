"""The dal command line, as a user runs it."""
import json
import subprocess
import sys

import pytest
import torch

import dal
from dal.checkpoint import load_checkpoint, save_checkpoint
from dal.cli import main
from dal.prepare import set_quantizer_state
from dal.zoo import MnistCNN


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    x = torch.randn(4, 1, 28, 28)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [torch.randn(4, 1, 28, 28) for _ in range(2)], progress=False)
    set_quantizer_state(q, "frozen")
    path = tmp_path_factory.mktemp("ckpt") / "qat.pt"
    save_checkpoint(q, path)
    return path, q


def test_checkpoint_round_trip_restores_the_model_exactly(checkpoint):
    path, q = checkpoint
    x = torch.randn(3, 1, 28, 28)
    restored = load_checkpoint(path, "dal.zoo:MnistCNN", example_inputs=(x,))
    q.eval()
    with torch.no_grad():
        assert torch.equal(restored(x), q(x))


def test_export_then_inspect_then_verify(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    onnx_path = tmp_path / "m.onnx"
    assert main(["export", "--model", "dal.zoo:MnistCNN", "--checkpoint", str(path), "--input-shape", "2,1,28,28",
                 "-o", str(onnx_path), "--dynamic-batch"]) == 0
    assert main(["inspect", str(onnx_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert info["metadata"]["dal.recipe"] == "int8_balanced"
    convs = [layer for layer in info["layers"] if layer["op"] == "Conv"]
    assert convs and all(layer["inputs"][1]["format"] == "int8" for layer in convs)
    assert main(["verify", str(onnx_path), "--random-input", "5,1,28,28", "--model", "dal.zoo:MnistCNN",
                 "--checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert "npu_vs_torch" in out and "npu_vs_ort" in out


@pytest.mark.parametrize("argv,message", [
    (["inspect", "/nonexistent.onnx"], "no such file"),
    (["verify", "/nonexistent.onnx", "--random-input", "1,2"], "No such file"),
    (["export", "--model", "nomodule", "--checkpoint", "x.pt", "--input-shape", "1,1", "-o", "y.onnx"],
     "package.module:function"),
])
def test_errors_say_what_to_do(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_shape_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as err:
        main(["verify", "m.onnx", "--random-input", "1,a,3"])
    assert err.value.code == 2
    assert "write it like 1,3,224,224" in capsys.readouterr().err


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "dal.cli.main", "--help"], capture_output=True, text=True, check=True)
    assert "inspect" in out.stdout and "verify" in out.stdout and "export" in out.stdout
