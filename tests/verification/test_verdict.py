"""One parity verdict, stable across inputs, attributed to the layer at fault, stated alike everywhere.

The same correct export of dal_examples.zoo.MnistCNN passes on 20 random inputs; the same export with one
conv's weight scale multiplied by 1.5 in the ONNX file fails on every input and names that conv
(not the quantizer after it); ``verdict()``, ``meets_criterion()``, ``dal verify --strict``'s exit
status, the printed report and the HTML report's verdict box agree on both files.
"""
import re

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import dal
import dal.npu
from dal.checkpoint import save_checkpoint
from dal.cli import main
from dal.prepare import set_quantizer_state
from dal_examples.zoo import MnistCNN

SHAPE = (8, 1, 28, 28)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model, checkpoint path, good .onnx, .onnx with conv's weight scale x 1.5)."""
    torch.manual_seed(0)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(torch.randn(SHAPE),))
    dal.calibrate(q, [torch.randn(SHAPE) for _ in range(3)], progress=False)
    set_quantizer_state(q, "frozen")
    q.eval()
    tmp = tmp_path_factory.mktemp("verdict")
    ckpt = tmp / "qat.pt"
    save_checkpoint(q, ckpt)
    good = tmp / "good.onnx"
    dal.export_onnx(q, (torch.randn(SHAPE),), good)
    proto = onnx.load(str(good))
    init = next(t for t in proto.graph.initializer if t.name == "conv.weight_quant.scale")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.5), init.name))
    bad = tmp / "bad_scale.onnx"
    onnx.save(proto, str(bad))
    return q, ckpt, good, bad


def _inputs(n):
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


def test_a_correct_export_passes_on_20_random_inputs(files):
    q, _, good, _ = files
    near = 0
    for x in _inputs(20):
        rep = dal.verify(good, q, (x,))
        assert rep.verdict() and rep.meets_criterion(), rep.verdict_line()
        assert rep.integer.identical
        rows = rep.layers_forced + rep.torch_layers
        assert rows and all(r.differ == r.near_ties and r.max_abs <= 1 for r in rows)
        near += sum(r.near_ties for r in rows)
    print(f"near-ties over 20 inputs: {near}")


def test_a_wrong_weight_scale_fails_every_time_and_names_the_conv(files):
    q, _, _, bad = files
    for x in _inputs(5):
        rep = dal.verify(bad, q, (x,))
        assert not rep.verdict() and not rep.meets_criterion()
        first = rep.first_failure()
        assert first.startswith("layer conv:"), first
        (row,) = [r for r in rep.layer_rows() if not r.passes][:1]
        # the failing row is the quantizer reading conv's output; the report names the conv itself
        assert row.node == "add.input_quants.1/QuantizeLinear" and row.layer == "conv"
        assert "first at fault: layer conv:" in str(rep).splitlines()[1]
        # the layers before it compute what they computed: they pass
        before = [r for r in rep.layer_rows() if rep.order[r.node] < rep.order[row.node]]
        assert before and all(r.passes for r in before)


def test_the_near_tie_view_does_not_let_a_real_difference_through(files):
    """A 1-LSB difference that is no near-tie fails: the scale x 1.001 moves codes by at most
    about 1 LSB (values up to a few hundred codes), far beyond the float32 bound."""
    q, _, good, _ = files
    proto = onnx.load(str(good))
    init = next(t for t in proto.graph.initializer if t.name == "conv.weight_quant.scale")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(1.001), init.name))
    rep = dal.verify(proto, q, (_inputs(1)[0],))
    row = next(r for r in rep.torch_layers if r.node == "add.input_quants.1/QuantizeLinear")
    assert row.max_abs == 1 and row.failures > 0 and not rep.verdict()


def _html_verdict(q, onnx_path, out):
    pytest.importorskip("matplotlib")
    data = _inputs(1)
    path = dal.report(q, data, None, onnx_path, out, num_batches=1, sensitivity=False, progress=False)
    text = path.read_text()
    return re.search(r'<div class="verdict[^"]*">(.*?)</div>', text, re.S).group(1)


@pytest.mark.parametrize("which", ["good", "bad"])
def test_verdict_strict_exit_printed_text_and_html_agree(files, which, capsys, tmp_path):
    q, ckpt, good, bad = files
    path = good if which == "good" else bad
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))  # what --random-input --seed 0 draws
    rep = dal.verify(path, q, (x,))
    assert rep.verdict() == (which == "good")
    capsys.readouterr()
    status = main(["verify", str(path), "--random-input", ",".join(map(str, SHAPE)), "--seed", "0",
                   "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(ckpt), "--strict"])
    printed = capsys.readouterr().out
    word = "PASS" if rep.verdict() else "FAIL"
    assert status == (0 if rep.verdict() else 1)
    assert f"VERDICT: {word}" in printed and f"VERDICT: {'FAIL' if rep.verdict() else 'PASS'}" not in printed
    assert rep.verdict_line() in printed  # the same sentence: same counts, same layer at fault
    box = _html_verdict(q, path, tmp_path / "r.html")
    assert f"VERDICT: {word}" in box and f"VERDICT: {'FAIL' if rep.verdict() else 'PASS'}" not in box
    assert "PASSES" not in box and "FAILS" not in box  # no second criterion beside it
    if not rep.verdict():
        assert "layer conv" in box and "layer conv" in printed


def test_cosine_per_output_and_per_layer(files):
    q, _, good, _ = files
    x = _inputs(1)[0]
    rep = dal.verify(good, q, (x,))
    (pairs,) = rep.outputs.values()
    # NPU vs the float model (quantizers off), computed here: float64 cosine of the outputs
    npu = dal.npu.run(onnx.load(str(good)), {onnx.load(str(good)).graph.input[0].name: x.numpy()})[0]
    with dal.quantizer_states(q, "off"), torch.no_grad():
        ref = q(x).double().numpy()
    a, b = npu.astype(np.float64).ravel(), ref.ravel()
    assert pairs["npu_vs_float"].cosine == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), abs=1e-12)
    for row in rep.layers_forced + rep.torch_layers:
        assert row.cosine is not None and 0.999 < row.cosine <= 1.0 + 1e-12
        assert row.float_cosine is not None and 0.9 < row.float_cosine <= 1.0 + 1e-12
    text = str(rep)
    assert "npu_vs_float" in text and "vs float" in text
