"""The dal command line, as a user runs it."""
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import dal
from dal.checkpoint import load_checkpoint, save_checkpoint
from dal.cli import main
from dal.prepare import set_quantizer_state
from dal_examples.zoo import MnistCNN


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
    restored = load_checkpoint(path, "dal_examples.zoo:MnistCNN", example_inputs=(x,))
    q.eval()
    with torch.no_grad():
        assert torch.equal(restored(x), q(x))


def test_export_then_inspect_then_verify(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    onnx_path = tmp_path / "m.onnx"
    assert main(["export", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(path), "--input-shape", "2,1,28,28",
                 "-o", str(onnx_path), "--dynamic-batch"]) == 0
    assert main(["inspect", str(onnx_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert info["metadata"]["dal.recipe"] == "int8_balanced"
    convs = [layer for layer in info["layers"] if layer["op"] == "Conv"]
    assert convs and all(layer["inputs"][1]["format"] == "int8" for layer in convs)
    assert main(["verify", str(onnx_path), "--random-input", "5,1,28,28", "--model", "dal_examples.zoo:MnistCNN",
                 "--checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert "npu_vs_torch" in out and "npu_vs_ort" in out


# ---- dal verify --strict ---------------------------------------------------------------------
# --strict (dal/cli/main.py) exits 1 unless ParityReport.verdict(): the integer model equals the NPU
# reference on every element, and every layer-by-layer difference is a near-tie (near_tie.py).

STRICT_SHAPE = (2, 1, 28, 28)


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    onnx_path = tmp_path_factory.mktemp("strict") / "m.onnx"
    shape = ",".join(map(str, STRICT_SHAPE))
    assert main(["export", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(path), "--input-shape", shape,
                 "-o", str(onnx_path)]) == 0
    return onnx_path


def _verify_strict(onnx_path, checkpoint_path):
    return main(["verify", str(onnx_path), "--random-input", ",".join(map(str, STRICT_SHAPE)), "--seed", "0",
                 "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(checkpoint_path), "--strict"])


def _strict_input():
    """The input `dal verify --random-input ... --seed 0` draws."""
    return torch.randn(STRICT_SHAPE, generator=torch.Generator().manual_seed(0))


def _rewritten(src, dst, edit):
    proto = onnx.load(str(src))
    edit(proto)
    onnx.save(proto, str(dst))
    return dst


def _tamper_head_weight(proto, q):
    """Change one int8 weight code of the head (Gemm): the one that meets the largest input."""
    seen = {}
    hook = q.get_submodule("head").register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0]))
    with torch.no_grad():
        q.eval()(_strict_input())
    hook.remove()
    col = int(seen["x"].abs().sum(0).argmax())
    gemm = next(n for n in proto.graph.node if n.op_type == "Gemm")
    dq = next(n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == gemm.input[1])
    init = next(t for t in proto.graph.initializer if t.name == dq.input[0])
    w = numpy_helper.to_array(init).copy()
    assert w.dtype == np.int8 and w.ndim == 2
    w[0, col] = -127 if w[0, col] >= 0 else 127
    init.CopyFrom(numpy_helper.from_array(w, init.name))


def test_verify_strict_passes_a_good_export(checkpoint, exported, capsys):
    path, _ = checkpoint
    assert _verify_strict(exported, path) == 0
    assert "npu_vs_ort" in capsys.readouterr().out


def test_verify_strict_fails_when_the_npu_and_onnxruntime_disagree(checkpoint, exported, tmp_path):
    # An 8-bit fixed-point requantizer in the metadata: the NPU reference applies it, the integer
    # model (dal.convert of the a2000 checkpoint: the float requantizer) does not, so they differ.
    path, _ = checkpoint

    def coarse(proto):
        entry = next(e for e in proto.metadata_props if e.key == "dal.requantizer")
        entry.value = json.dumps({"kind": "fixed_point", "multiplier_bits": 8, "rounding": "half_up"})
    bad = _rewritten(exported, tmp_path / "coarse.onnx", coarse)
    assert _verify_strict(bad, path) == 1


def test_verify_strict_fails_on_a_tampered_weight(checkpoint, exported, tmp_path):
    path, q = checkpoint
    bad = _rewritten(exported, tmp_path / "tampered.onnx", lambda proto: _tamper_head_weight(proto, q))
    # The tamper is real: the NPU reference and torch now disagree by more than one LSB.
    report = dal.verify(bad, q, (_strict_input(),))
    (pairs,) = report.outputs.values()
    assert pairs["npu_vs_torch"].off_by_more > 0, report
    assert _verify_strict(bad, path) != 0


@pytest.mark.parametrize("argv,message", [
    (["inspect", "/nonexistent.onnx"], "no such file"),
    (["verify", "/nonexistent.onnx", "--random-input", "1,2"], "no such file"),
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
    assert "like 1,3,224,224" in capsys.readouterr().err


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "dal.cli", "--help"], capture_output=True, text=True, check=True)
    assert "inspect" in out.stdout and "verify" in out.stdout and "export" in out.stdout
