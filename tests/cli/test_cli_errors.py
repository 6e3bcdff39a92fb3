"""Every bad input to every ``dal`` subcommand: exit status 2 and ONE line on stderr that names the
option or file at fault (no traceback)."""
import sys

import numpy as np
import pytest
import torch

import dal
from dal.checkpoint import save_checkpoint
from dal.cli import main
from dal_examples.zoo import MnistCNN


def assert_one_line_error(err: str, command: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith(f"dal {command}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, mnist_onnx):
    """Files that are not what their option wants, by name."""
    root = tmp_path_factory.mktemp("bad")
    files = {"onnx": mnist_onnx, "text": root / "notes.txt", "tensor": root / "tensor.pt",
             "dict": root / "dict.pt", "truncated": root / "truncated.onnx", "folder": root}
    files["text"].write_text("not a checkpoint\n")
    torch.save(torch.zeros(3), files["tensor"])
    torch.save({"weights": 1}, files["dict"])
    files["truncated"].write_bytes(mnist_onnx.read_bytes()[: mnist_onnx.stat().st_size // 2])
    torch.manual_seed(0)
    narrow = dal.prepare_qat(MnistCNN(width=8), recipe="int8_balanced", hardware="a2000",
                             example_inputs=(torch.randn(2, 1, 28, 28),))
    files["narrow"] = root / "narrow.pt"  # a checkpoint of another model than dal_examples.zoo:MnistCNN()
    save_checkpoint(narrow, files["narrow"])
    files["bad_recipe"] = root / "bad_recipe.pt"
    torch.save({"state_dict": {}, "recipe": {"rules": [{"match": "*", "weight": "int3"}]}}, files["bad_recipe"])
    return files


EXPORT = ["export", "--model", "dal_examples.zoo:MnistCNN", "--input-shape", "4,1,28,28"]

CASES = [  # (id, argv with {name} placeholders for bad_files / the good files, words the message must hold)
    ("export-onnx-as-checkpoint", EXPORT + ["--checkpoint", "{onnx}", "-o", "{out}"], ["--checkpoint", "not a dal checkpoint"]),
    ("export-text-as-checkpoint", EXPORT + ["--checkpoint", "{text}", "-o", "{out}"], ["--checkpoint", "not a dal checkpoint"]),
    ("export-tensor-as-checkpoint", EXPORT + ["--checkpoint", "{tensor}", "-o", "{out}"], ["holds a Tensor"]),
    ("export-dict-as-checkpoint", EXPORT + ["--checkpoint", "{dict}", "-o", "{out}"], ["without ['state_dict', 'recipe']"]),
    ("export-missing-checkpoint", EXPORT + ["--checkpoint", "{folder}/nope.pt", "-o", "{out}"], ["--checkpoint", "no such file"]),
    ("export-folder-as-checkpoint", EXPORT + ["--checkpoint", "{folder}", "-o", "{out}"], ["is a directory"]),
    ("export-other-model", EXPORT + ["--checkpoint", "{narrow}", "-o", "{out}"],
     ["with --model dal_examples.zoo:MnistCNN", "written by a prepared MnistCNN", "has other parameters"]),
    ("export-bad-recipe", EXPORT + ["--checkpoint", "{bad_recipe}", "-o", "{out}"], ["int3"]),
    ("export-no-folder", EXPORT + ["--checkpoint", "{good}", "-o", "{folder}/no/such/m.onnx"], ["-o", "does not exist"]),
    ("export-bad-factory", ["export", "--model", "nomodule", "--checkpoint", "{good}", "--input-shape", "1,1,28,28",
                            "-o", "{out}"], ["--model", "package.module:function"]),
    ("export-missing-factory", ["export", "--model", "dal_examples.zoo:NoSuchNet", "--checkpoint", "{good}", "--input-shape",
                                "1,1,28,28", "-o", "{out}"], ["--model", "NoSuchNet"]),
    ("export-wrong-shape", ["export", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", "{good}", "--input-shape",
                            "1,3,28,28", "-o", "{out}"], ["does not run on an input of shape (1, 3, 28, 28)"]),
    ("verify-missing-file", ["verify", "{folder}/nope.onnx", "--random-input", "4,1,28,28"], ["nope.onnx: no such file"]),
    ("verify-truncated", ["verify", "{truncated}", "--random-input", "4,1,28,28"], ["truncated.onnx", "not a readable ONNX"]),
    ("verify-wrong-batch", ["verify", "{onnx}", "--random-input", "8,1,28,28"], ["dimension 0 must be 4", "dynamic_batch"]),
    ("verify-wrong-rank", ["verify", "{onnx}", "--random-input", "4,28,28"], ["3-D", "4-D"]),
    ("verify-wrong-size", ["verify", "{onnx}", "--random-input", "4,1,32,32"], ["dimension 2 must be 28"]),
    ("verify-text-input", ["verify", "{onnx}", "--input", "{text}"], ["--input", "not a .npy"]),
    ("verify-missing-input", ["verify", "{onnx}", "--input", "{folder}/x.npy"], ["--input", "no such file"]),
    ("verify-float64-input", ["verify", "{onnx}", "--input", "{npy64}"], ["float64", "float32"]),
    ("verify-checkpoint-without-model", ["verify", "{onnx}", "--random-input", "4,1,28,28", "--checkpoint", "{good}"],
     ["--checkpoint needs --model"]),
    ("verify-model-without-checkpoint", ["verify", "{onnx}", "--random-input", "4,1,28,28", "--model",
                                         "dal_examples.zoo:MnistCNN"], ["--model needs --checkpoint"]),
    ("inspect-truncated", ["inspect", "{truncated}"], ["truncated.onnx", "not a readable ONNX"]),
    ("inspect-missing", ["inspect", "{folder}/nope.onnx"], ["no such file"]),
    ("report-missing-onnx", ["report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", "{good}", "--random-input",
                             "4,1,28,28", "--onnx", "{folder}/nope.onnx", "--out", "{out}.html"], ["--onnx", "no such file"]),
    ("report-text-as-checkpoint", ["report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", "{text}",
                                   "--random-input", "4,1,28,28", "--out", "{out}.html"], ["not a dal checkpoint"]),
    ("report-zero-batches", ["report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", "{good}", "--random-input",
                             "4,1,28,28", "--num-batches", "0", "--out", "{out}.html"], ["--num-batches"]),
]


@pytest.mark.parametrize("argv,needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_status_2(argv, needles, bad_files, mnist_checkpoint, tmp_path, capsys):
    np.save(tmp_path / "x64.npy", np.zeros((4, 1, 28, 28)))
    names = {**{k: str(v) for k, v in bad_files.items()}, "good": str(mnist_checkpoint),
             "out": str(tmp_path / "out.onnx"), "npy64": str(tmp_path / "x64.npy")}
    argv = [a.format(**names) for a in argv]
    assert main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, argv[0], *needles)
    assert not (tmp_path / "out.onnx").exists()


def test_report_without_matplotlib_names_the_extra(mnist_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "r.html"
    assert main(["report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(mnist_checkpoint),
                 "--random-input", "4,1,28,28", "--out", str(out)]) == 2
    assert_one_line_error(capsys.readouterr().err, "report", "pip install 'dal[report]'")
    assert not out.exists()


@pytest.mark.parametrize("shape", ["8,x,28", "1,,3", "1,a,3", "0,1,28,28", "2.5,3"])
def test_bad_shape_is_one_line_from_the_real_command(shape, mnist_onnx, run_dal):
    out = run_dal("verify", mnist_onnx, "--random-input", shape)
    assert out.returncode == 2
    assert_one_line_error(out.stderr, "verify", "--random-input", repr(shape))


def test_export_of_a_non_checkpoint_from_the_real_command(mnist_onnx, tmp_path, run_dal):
    out = run_dal("export", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", mnist_onnx, "--input-shape", "4,1,28,28",
                  "-o", tmp_path / "m.onnx")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert_one_line_error(out.stderr, "export", f"--checkpoint {mnist_onnx}", "not a dal checkpoint")


def test_a_failed_cpp_build_is_one_line(mnist_onnx, monkeypatch, capsys):
    import dal.npu.build as build

    def no_compiler(*args, **kwargs):
        raise build.BuildError("dal.npu needs a C++ compiler to build its kernels: 'c++' was not found on PATH. "
                               "Install one, e.g. `apt-get install g++`, and retry.")

    monkeypatch.setattr(build, "kernels", no_compiler)  # what a machine without a compiler gets
    assert main(["verify", str(mnist_onnx), "--random-input", "4,1,28,28"]) == 2
    assert_one_line_error(capsys.readouterr().err, "verify", "needs a C++ compiler", "apt-get install g++")
