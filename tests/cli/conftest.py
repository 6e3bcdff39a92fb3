"""A small trained-enough QAT checkpoint of dal_examples.zoo.MnistCNN and its export, shared by the CLI tests."""
import subprocess
import sys

import pytest
import torch

import dal
from dal.checkpoint import save_checkpoint
from dal.prepare import set_quantizer_state
from dal_examples.zoo import MnistCNN

SHAPE = (4, 1, 28, 28)


@pytest.fixture(scope="package")
def mnist_checkpoint(tmp_path_factory):
    """Path of a frozen int8_balanced / a2000 checkpoint of MnistCNN (calibrated on random data)."""
    torch.manual_seed(0)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(torch.randn(SHAPE),))
    dal.calibrate(q, [torch.randn(SHAPE) for _ in range(2)], progress=False)
    set_quantizer_state(q, "frozen")
    path = tmp_path_factory.mktemp("cli-ckpt") / "qat.pt"
    save_checkpoint(q, path)
    return path


@pytest.fixture(scope="package")
def mnist_onnx(mnist_checkpoint, tmp_path_factory):
    """The checkpoint exported with a fixed batch of 4 (no --dynamic-batch)."""
    from dal.cli import main

    path = tmp_path_factory.mktemp("cli-onnx") / "m.onnx"
    assert main(["export", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(mnist_checkpoint),
                 "--input-shape", ",".join(map(str, SHAPE)), "-o", str(path)]) == 0
    return path


@pytest.fixture
def run_dal():
    """The real command line in a fresh interpreter: ``run_dal(*argv, env=None)`` -> CompletedProcess."""
    def run(*argv, env=None):
        return subprocess.run([sys.executable, "-m", "dal.cli", *map(str, argv)], capture_output=True, text=True,
                              env=env)
    return run
