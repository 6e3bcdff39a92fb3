"""dal.calibrate(method=...): minmax, percentile, kl, mse, easyquant on a briefly trained MNIST CNN."""
import copy
import math

import pytest
import torch
from oracles import assert_lsb_parity, lsb_stats, output_scale, run_ort
from mnist_helpers import accuracy, prepared

import dal
from dal.observers import MinMaxObserver
from dal.prepare import set_quantizer_state
from dal.prepare.state import quantizers

METHODS = ["minmax", "percentile", "kl", "mse", "easyquant"]


def _scales(model):
    return {n: (q.scale.detach().clone(), q.zero_point.detach().clone(), q.state) for n, q in quantizers(model)}


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("method", METHODS)
def test_method_calibrates_every_quantizer(mnist, method):
    net, calib, test = mnist
    q = prepared(net, "int8_balanced")
    dal.calibrate(q, calib[:2], method=method, progress=False)
    for name, fq in quantizers(q):
        assert fq.state == "quantize", name
        assert fq.initialized and bool(torch.isfinite(fq.scale).all()) and bool((fq.scale > 0).all()), name
    x = test[0][0]
    with torch.no_grad():
        assert bool(torch.isfinite(q(x)).all())
    if method != "kl":
        # int8 PTQ stays close to float. Not with kl: dal's KLObserver (TensorRT's entropy search)
        # clips MNIST's spiky activations (background value, ReLU zeros) far too hard; see
        # bench/calibration.py and the report.
        assert accuracy(q, test) > accuracy(net, test) - 5.0


@pytest.mark.parametrize("method", ["percentile", "kl", "mse"])
def test_recipe_observer_is_handed_back_and_checkpoints_load(mnist, method):
    net, calib, test = mnist
    q = prepared(net, "int8_balanced")
    dal.calibrate(q, calib, method=method, progress=False)
    act = q.get_submodule("down.0").input_quant
    assert type(act.observer).__name__ == "MovingAverageMinMaxObserver"
    # The seeded observer proposes the scale the method chose.
    s, z = act.observer.calculate_qparams()
    assert torch.equal(s, act.scale) and torch.equal(z, act.zero_point)
    fresh = prepared(net, "int8_balanced")
    fresh.load_state_dict(q.state_dict())  # strict: same keys as a fresh prepare_qat
    x = test[0][0][:32]
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), q.eval()(x))


def test_mse_searches_per_channel_weight_ranges(mnist):
    net, calib, _ = mnist
    mm, mse = prepared(net), prepared(net)
    dal.calibrate(mm, calib, progress=False)
    dal.calibrate(mse, calib, method="mse", progress=False)
    a, b = mm.get_submodule("down.0").weight_quant.scale, mse.get_submodule("down.0").weight_quant.scale
    assert a.shape == b.shape and a.numel() > 1  # per channel kept
    assert bool((b <= a * (1 + 1e-6)).all()) and bool((b < a).any())  # MSE clips int4 weights


def _layer_io(model, path, x):
    """(input, output) of ``model``'s submodule ``path`` on ``x`` (eval, no grad)."""
    seen = {}
    hook = model.get_submodule(path).register_forward_hook(lambda m, i, o: seen.update(i=i[0], o=o))
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        hook.remove()
    return seen["i"], seen["o"]


def test_easyquant_never_leaves_a_layer_further_from_float_than_minmax(mnist):
    """EasyQuant's guarantee (its grid holds every scale it starts from): on the batches it
    searched, each layer's output, from the inputs the tuned model gives it, is at least as close
    (cosine) to the float layer's output as the same layer with the min-max scales it started
    from. (End to end it usually helps too, but a per-layer greedy search does not promise it:
    on one machine's trained net it came out 0.99667 against min-max's 0.99704.)"""
    net, calib, _ = mnist
    x = torch.cat([b[0] for b in calib[:2]])
    mm, eq = prepared(net), prepared(net)
    dal.calibrate(mm, calib, progress=False)
    dal.calibrate(eq, calib, method="easyquant", search_batches=2, progress=False)
    changed = 0
    for path in ("stem.0", "down.0", "conv", "down2.0", "head"):
        with dal.quantizer_states(eq, "off"):
            _, float_out = _layer_io(eq, path, x)
        layer_in, eq_out = _layer_io(eq, path, x)
        start = copy.deepcopy(eq.get_submodule(path))
        for role, q in start.quantizers().items():
            q.set_qparams(*mm.get_submodule(path).quantizers()[role].effective_qparams())
        with torch.no_grad():
            mm_out = start.eval()(layer_in)
        assert _cos(eq_out, float_out) >= _cos(mm_out, float_out), path
        changed += not torch.equal(eq_out, mm_out)
    assert changed >= 3  # the search moved most layers' scales
    # QAT continues from the searched activation ranges: the moving-average observer was moved
    # to them, so one training step moves a scale by at most its averaging constant (1%).
    x = torch.cat([b[0] for b in calib])
    before = eq.get_submodule("head").input_quant.scale.clone()
    eq.train()
    eq(x[:8]).sum().backward()
    assert torch.allclose(eq.get_submodule("head").input_quant.scale, before, rtol=0.02)


def _nan_batches(calib):
    bad = calib[1][0].clone()
    bad[0, 0, 3, 3] = float("nan")
    return [calib[0], (bad, calib[1][1]), calib[2]]


@pytest.mark.parametrize("method", METHODS)
def test_nan_batch_is_named_and_never_reaches_saved_scales(mnist, method):
    net, calib, _ = mnist
    q = prepared(net)
    dal.calibrate(q, calib, progress=False)
    before = _scales(q)
    with pytest.raises(ValueError, match=r"batch 1.*NaN"):
        dal.calibrate(q, _nan_batches(calib), method=method, progress=False)
    after = _scales(q)
    for name, (s, z, state) in before.items():
        assert torch.equal(after[name][0], s) and torch.equal(after[name][1], z), name
        if method != "minmax":  # the methods also put states back; the plain loop leaves 'observe'
            assert after[name][2] == state, name
    # From scratch: nothing non-finite anywhere after the failure.
    fresh = prepared(net)
    with pytest.raises(ValueError, match="NaN"):
        dal.calibrate(fresh, _nan_batches(calib), method=method, progress=False)
    for name, fq in quantizers(fresh):
        assert bool(torch.isfinite(fq.scale).all()), name


@pytest.mark.parametrize("method", METHODS)
def test_empty_loader_and_wrong_shapes_are_named(mnist, method):
    net, _, _ = mnist
    with pytest.raises(ValueError, match="no batch"):
        dal.calibrate(prepared(net), [], method=method, progress=False)
    with pytest.raises(ValueError, match=r"input shapes \[\(4, 3, 28, 28\)\]"):
        dal.calibrate(prepared(net), [torch.randn(4, 3, 28, 28)], method=method, progress=False)


def test_unknown_method_lists_the_known_ones(mnist):
    with pytest.raises(ValueError, match="easyquant"):
        dal.calibrate(prepared(mnist[0]), mnist[1], method="entropy", progress=False)


@pytest.mark.parametrize("method", ["kl", "easyquant"])
def test_ptq_export_and_qat_start_from_a_method(mnist, method, tmp_path):
    net, calib, test = mnist
    q = prepared(net)
    dal.calibrate(q, calib, method=method, progress=False)
    # QAT starts from the calibrated model: a few steps, finite loss.
    opt = torch.optim.SGD(q.parameters(), lr=0.01)
    q.train()
    for x, y in calib[:2]:
        loss = torch.nn.functional.cross_entropy(q(x), y)
        assert math.isfinite(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # PTQ flow: calibrate, freeze, export; onnxruntime agrees with torch on the prediction.
    set_quantizer_state(q, "frozen")
    q.eval()
    x = test[0][0][:16]
    path = tmp_path / f"{method}.onnx"
    dal.export_onnx(q, (x,), path)
    out = run_ort(path, {"input": x.numpy()})[0]
    with torch.no_grad():
        ref = q(x).numpy()
    # Parity in LSB of the output quantizer (measured: 160 of 160 outputs at 0 LSB for both methods).
    stats = lsb_stats(out, ref, output_scale(path))
    print(f"{method}: onnxruntime vs torch: {stats}")
    assert_lsb_parity(stats, method)
    assert isinstance(q.get_submodule("head").weight_quant.observer, MinMaxObserver)
