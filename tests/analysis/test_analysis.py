"""dal.analysis: layerwise error, sensitivity, auto FP16 fallback, HTML report (briefly trained MNIST CNN)."""
import base64
import copy
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import onnx
import pytest
import torch
from mnist_helpers import W4A8, accuracy, prepared

import dal
from dal.analysis import auto_fallback, layerwise, sensitivity
from dal.prepare import set_quantizer_state
from dal.prepare.state import quantizers


@pytest.fixture(scope="module")
def w4a8(mnist):
    net, calib, test = mnist
    q = prepared(net)
    dal.calibrate(q, calib, progress=False)
    return net, q, calib[:2], test


def _states(model):
    return [(n, q.state, q.scale.clone()) for n, q in quantizers(model)]


def _unchanged(before, model):
    return all(s == q.state and torch.equal(sc, q.scale) for (n, s, sc), (_, q) in zip(before, quantizers(model)))


def test_layerwise_compares_fused_layers_after_bn_and_relu(w4a8):
    net, q, data, _ = w4a8
    before = _states(q)
    rep = layerwise(net, q, data, progress=False)
    assert _unchanged(before, q)
    rows = {r["layer"]: r for r in rep.rows}
    assert [r["layer"] for r in rep.rows] == ["stem.0", "down.0", "conv", "add", "down2.0", "head"]  # execution order
    assert rows["stem.0"]["reference"] == "float stem.1 + relu" and rows["conv"]["reference"] == "float bn"
    assert rows["add"]["reference"] == "qat, quantizers off"  # a functional + has no float module
    # Oracle for stem.0: its output against relu(bn(conv(x))) of the float model, by hand.
    x = torch.cat([b[0] for b in data])
    with torch.no_grad():
        q.eval()
        got = q.get_submodule("stem.0")(x)
        ref = net.stem(x)
    cos = float(torch.nn.functional.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0))
    assert rows["stem.0"]["cosine"] == pytest.approx(cos, abs=1e-9)
    assert rows["stem.0"]["max_abs"] == pytest.approx(float((got - ref).abs().max()), rel=1e-6)
    for r in rep.rows:
        assert 0.9 < r["cosine"] <= 1.0 and r["mse"] > 0 and r["psnr"] > 10 and r["mae"] > 0
    text = str(rep)
    assert "cosine" in text and "PSNR" in text and "head" in text


def test_layerwise_refuses_an_uncalibrated_model(mnist):
    with pytest.raises(ValueError, match="still observing"):
        layerwise(mnist[0], prepared(mnist[0]), mnist[1], progress=False)


def test_sensitivity_ranks_and_restores(w4a8):
    net, q, data, test = w4a8
    before = _states(q)
    rep = sensitivity(q, data, progress=False)
    assert _unchanged(before, q)
    assert {r["layer"] for r in rep.rows} == {"stem.0", "down.0", "conv", "add", "down2.0", "head"}
    assert rep.all_float == pytest.approx(1.0) and rep.all_quantized < 1.0
    drops = [r["drop"] for r in rep.ranked]
    assert drops == sorted(drops, reverse=True)
    assert "rank" in str(rep)
    # A user metric (accuracy) works the same way.
    acc = sensitivity(q, None, metric=lambda m: accuracy(m, test[:1]), layers=["head", "stem.0"], progress=False)
    assert {r["layer"] for r in acc.rows} == {"head", "stem.0"} and acc.all_float > 50


def _fp16_cast_count(proto):
    return sum(1 for n in proto.graph.node if n.op_type == "Cast"
               and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute))


def _two_badly_scaled_inputs(k: float = 1000.0) -> torch.nn.Module:
    """A MnistCNN built, not trained (seeded: the same weights on every CPU), whose down.0 and
    head read one channel ``k`` times larger than the others (the BN before each scaled, the
    weights reading that channel divided: the same function for every ``k``). With k = 1000
    their per-tensor INT8 input grids are 1000x too coarse for every other channel, so
    quantizing either alone costs far more than any other layer (measured cosine drops: head
    0.58, down.0 0.071, then 0.0007): a ranking no CPU's rounding can reorder."""
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)
    net = MnistCNN().eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
        for bn in (net.stem[1], net.down2[1]):
            bn.weight[0] *= k
            bn.bias[0] *= k
        net.down[0].weight[:, 0] /= k
        net.head.weight.view(net.head.out_features, net.down2[0].out_channels, -1)[:, 0] /= k
    return net


def test_auto_fallback_needs_no_more_layers_than_the_two_badly_scaled_ones(mnist, tmp_path):
    _, calib, _ = mnist
    data = calib[:2]
    net = _two_badly_scaled_inputs()
    q = prepared(net)
    dal.calibrate(q, calib, progress=False)
    x = data[0][0]
    with torch.no_grad():  # the same function as with k = 1 (compared in float64)
        a, b = net.double()(x.double()), _two_badly_scaled_inputs(1.0).double()(x.double())
        net.float()
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-6  # the weights were scaled in float32
    by_hand = dal.load_recipe(W4A8).with_rules_prepended(
        [{"match": "down.0", "fallback": "fp16"}, {"match": "head", "fallback": "fp16"}])
    hand = prepared(net, by_hand)
    dal.calibrate(hand, data, progress=False)
    # The target is what the by-hand recipe scores under auto_fallback's own measure (the output
    # against the same model with quantizers off, over the same batches).
    from dal.analysis.evaluator import Evaluator

    with torch.no_grad():
        hand_cos = Evaluator(hand.eval(), data, "cosine")()
    res = auto_fallback(q, data, target=hand_cos, float_model=net, example_inputs=(x,), progress=False)
    assert res.met and res.verified_metric >= hand_cos, str(res)
    # The sensitivity ranking puts the two badly scaled layers first. The search scores candidates
    # without re-calibrating their neighbours, so it may stop one layer later than a re-prepared
    # model would: at most one layer more than by hand.
    assert set(res.layers[:2]) == {"down.0", "head"} and len(res.layers) <= 3, str(res)
    # The recipe saves, reloads, re-prepares; the exporter keeps those layers in FP16.
    path = tmp_path / "fallback.yaml"
    res.recipe.to_yaml(path)
    again = prepared(net, dal.load_recipe(str(path)))
    rows = {r.name: r.status for r in dal.prepared(again).report.rows}
    assert all(rows[name] == "fp16" for name in res.layers)
    dal.calibrate(again, data, progress=False)
    set_quantizer_state(again, "frozen")
    proto = dal.export_onnx(again, (x,), tmp_path / "fallback.onnx")
    assert _fp16_cast_count(proto) >= len(res.layers)
    # Each fallback layer's operator runs on float16 inputs produced by a Cast(to=float16).
    producers = {o: n for n in proto.graph.node for o in n.output}
    half_ops = [n for n in proto.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")
                and (p := producers.get(n.input[0])) is not None and p.op_type == "Cast"]
    assert len(half_ops) >= len(res.layers)
    baseline = copy.deepcopy(q)
    set_quantizer_state(baseline, "frozen")
    assert _fp16_cast_count(dal.export_onnx(baseline, (x,), tmp_path / "base.onnx")) == 0


class _Checker(HTMLParser):
    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.imgs, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs).get("src", ""))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"unbalanced </{tag}> (open: {self.stack[-3:]})")
        else:
            self.stack.pop()


def test_html_report_is_self_contained(w4a8, tmp_path):
    from dal.analysis.report import build_report

    net, q, data, _ = w4a8
    x = data[0][0]
    frozen = copy.deepcopy(q)
    set_quantizer_state(frozen, "frozen")
    onnx_path = tmp_path / "m.onnx"
    dal.export_onnx(frozen, (x,), onnx_path)
    out = build_report(frozen, data, net, onnx_path, tmp_path / "report.html", num_batches=2, progress=False)
    text = out.read_text()
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert not checker.errors and checker.stack == [], (checker.errors, checker.stack)
    assert len(checker.imgs) >= 4  # error bars, weight and activation histograms, sensitivity
    for src in checker.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    for heading in ("Summary", "Per-layer output error", "Weight histograms", "Activation histograms",
                    "Sensitivity", "Parity"):
        assert heading in text
    assert "http://" not in text and "https://" not in text
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser:  # optional: render headless when a browser is installed
        shot = tmp_path / "shot.png"
        subprocess.run([browser, "--headless", "--no-sandbox", f"--screenshot={shot}", out.as_uri()],
                       check=True, capture_output=True)
        assert shot.stat().st_size > 0


def test_report_cli_from_a_checkpoint(w4a8, tmp_path):
    from dal.checkpoint import save_checkpoint
    from dal.cli import main

    net, q, _, _ = w4a8
    ckpt = tmp_path / "q.pt"
    save_checkpoint(q, ckpt)
    out = tmp_path / "cli.html"
    assert main(["report", "--model", "dal_examples.zoo:MnistCNN", "--checkpoint", str(ckpt), "--random-input", "8,1,28,28",
                 "--out", str(out), "--num-batches", "1", "--no-sensitivity"]) == 0
    assert "Per-layer output error" in out.read_text()


def test_import_dal_analysis_does_not_import_matplotlib():
    code = "import sys, dal.analysis; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_layerwise_reference_survives_an_in_place_residual_add():
    """ResNet's ``out += identity`` runs in place on the last conv's output: the float reference
    of that conv must be the conv's output, not the sum (checked against the float conv itself)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            out = self.conv(x)
            out += x
            return out

    torch.manual_seed(0)
    net = Block().eval()
    q = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(torch.randn(2, 4, 8, 8),))
    data = [torch.randn(8, 4, 8, 8) for _ in range(2)]
    dal.calibrate(q, data, progress=False)
    row = {r["layer"]: r for r in layerwise(net, q, data, progress=False).rows}["conv"]
    x = torch.cat(data)
    with torch.no_grad():
        got, ref = q.eval().get_submodule("conv")(x), net.conv(x)
    cos = float(torch.nn.functional.cosine_similarity(got.flatten().double(), ref.flatten().double(), dim=0))
    assert row["cosine"] == pytest.approx(cos, abs=1e-9) and cos > 0.99


def test_simulated_fp16_fallback_computes_what_prepare_builds(w4a8):
    """auto_fallback's in-place FP16 simulation of a layer gives, from the same input, exactly the
    output of the layer prepare_qat builds for a ``fallback: fp16`` rule (FP16 input, weight, bias
    and output): so the metric it ranks with is the one the re-prepared model will have."""
    from dal.analysis.fallback import fp16_fallback

    net, q, calib, _ = w4a8
    layer = next(n for n, m in q.named_modules() if n and hasattr(m, "weight_quant") and n != "conv1")
    recipe = dal.prepared(q).recipe.with_rules_prepended([{"match": layer, "fallback": "fp16"}])
    rebuilt = dal.prepare_qat(copy.deepcopy(net), recipe=recipe, hardware="a2000",
                              example_inputs=(torch.zeros(2, 1, 28, 28),))
    dal.calibrate(rebuilt, calib, progress=False)
    built = rebuilt.get_submodule(layer)
    assert built.output_quant is not None and built.output_quant.fmt.name.lower() == "fp16"
    x = torch.randn(4, *_layer_input_shape(q, layer, calib[0][0]))
    q.eval(), rebuilt.eval()
    built.load_state_dict(q.get_submodule(layer).state_dict(), strict=False)  # same weights and bias
    original = q.get_submodule(layer).output_quant
    with torch.no_grad(), fp16_fallback(q, [layer]):
        simulated = q.get_submodule(layer)(x)
    with torch.no_grad():
        expected = built(x)
    assert torch.equal(simulated, expected)
    assert torch.equal(simulated, simulated.half().float())  # the output is an FP16 value
    assert q.get_submodule(layer).output_quant is original  # restored


def _layer_input_shape(model, layer, x):
    shape = []
    h = model.get_submodule(layer).register_forward_pre_hook(lambda m, a: shape.append(tuple(a[0].shape[1:])))
    with torch.no_grad():
        model.eval()(x)
    h.remove()
    return shape[0]
