"""``dal report`` takes its options like the other subcommands, with --help, and writes the report."""
import re

import torch


def test_report_help_is_the_report_s_own(run_dal):
    out = run_dal("report", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: dal report")
    for option in ("--model", "--checkpoint", "--random-input", "--data", "--onnx", "--out", "--num-batches"):
        assert option in out.stdout
    assert "dal[report]" in out.stdout


def test_report_runs_on_a_checkpoint_with_random_input(mnist_checkpoint, mnist_onnx, tmp_path, run_dal):
    out_file = tmp_path / "report.html"
    out = run_dal("report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", mnist_checkpoint, "--random-input",
                  "4,1,28,28", "--num-batches", "2", "--onnx", mnist_onnx, "--out", out_file)
    assert out.returncode == 0, out.stderr
    assert f"wrote {out_file}" in out.stdout
    html = out_file.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert "MnistCNN" in html and "int8_balanced" in html
    # the parity section ran dal.verify on the exported file (not an error message in its place)
    assert "npu_vs_torch" in html and "dal.verify failed" not in html
    assert re.search(r"data:image/png;base64,", html)


def labelled_batches():
    """A --data factory: a one-shot generator of (inputs, targets) pairs."""
    g = torch.Generator().manual_seed(1)
    return ((torch.randn(4, 1, 28, 28, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(3))


def test_report_data_factory(mnist_checkpoint, tmp_path, capsys):
    from dal.cli import main

    out_file = tmp_path / "r.html"
    # a --data factory named package.module:function (this test module is importable under its name)
    assert main(["report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(mnist_checkpoint), "--data",
                 f"{__name__}:labelled_batches", "--num-batches", "2", "--no-sensitivity", "--out", str(out_file)]) == 0
    assert "Per-layer output error" in out_file.read_text()
