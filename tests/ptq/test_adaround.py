"""AdaRound (dal.ptq.adaround): each weight rounded down or up, h(V) driven to 0/1, the learned
codes exported as they are (read back from the ONNX initializers)."""
import copy

import numpy as np
import pytest
import torch

import dal
from dal.ptq import adaround, learned_codes, rectified_sigmoid
from dal.ptq.rounding import beta_at, round_regularizer
from ptq_helpers import W4A8_PER_CHANNEL, mnist_cnn


def _model_and_data():
    return mnist_cnn()


@pytest.fixture(scope="module")
def rounded():
    """(float model, calibrated W4A8 model before AdaRound, after AdaRound, report, calib, test)."""
    net, calib, test = _model_and_data()
    q = dal.prepare_qat(copy.deepcopy(net), recipe=W4A8_PER_CHANNEL, hardware="a2000",
                        example_inputs=(torch.zeros(2, 1, 28, 28),))
    dal.calibrate(q, calib, progress=False)
    before = copy.deepcopy(q)
    rep = adaround(q, calib, iters=300, batch_size=8, progress=False)
    return net, before, q, rep, calib, test


def _grid(mod):
    w = mod.folded_weight_and_bias()[0] if hasattr(mod, "folded_weight_and_bias") else mod.weight
    s, z = mod.weight_quant.effective_qparams()
    g = mod.weight_quant.granularity
    return w.detach().double(), g.expand(s.double(), w.shape), g.expand(z.double(), w.shape)


def test_every_weight_is_floor_or_ceil(rounded):
    _, before, after, rep, _, _ = rounded
    b_mods, a_mods = dict(before.named_modules()), dict(after.named_modules())
    assert [r["layer"] for r in rep.rows] == ["stem.0", "down.0", "conv", "down2.0", "head"]
    for row in rep.rows:
        w, s, z = _grid(b_mods[row["layer"]])
        q = a_mods[row["layer"]].weight_quant
        lo, hi = q.qmin, q.qmax
        floor = torch.clamp(torch.floor(w / s) + z, lo, hi)
        ceil = torch.clamp(torch.floor(w / s) + 1 + z, lo, hi)
        codes = learned_codes(a_mods[row["layer"]]).double()
        assert bool(((codes == floor) | (codes == ceil)).all()), row["layer"]
        # The scale was not recomputed from the new weights.
        assert torch.equal(q.scale, b_mods[row["layer"]].weight_quant.scale)
        assert q.state == "frozen"
    # Learned rounding is not round-to-nearest everywhere (else the test above proves nothing).
    assert max(r["flipped"] for r in rep.rows) > 0.01


def test_regulariser_drives_h_to_zero_or_one(rounded):
    _, _, _, rep, _, _ = rounded
    for row in rep.rows:
        h = row["h"]
        undecided = float(((h > 0.05) & (h < 0.95)).float().mean())
        assert undecided < 0.05, (row["layer"], undecided)


def test_regulariser_and_relaxation_formulas():
    v = torch.tensor([-50.0, 0.0, 50.0])
    # sigmoid(0) * 1.2 - 0.1 = 0.5; the stretch reaches exactly 0 and 1 before saturating.
    assert rectified_sigmoid(v).tolist() == [0.0, 0.5, 1.0]
    h = torch.tensor([0.0, 1.0, 0.5])
    assert float(round_regularizer(h, 2.0)) == pytest.approx(1.0)  # only h = 0.5 costs (1 - 0)
    assert beta_at(0, 100) is None and beta_at(20, 100) == pytest.approx(20.0)
    assert beta_at(99, 100) == pytest.approx(2.0 + 18.0 / 80.0)


def test_exported_weights_are_the_learned_codes(rounded, tmp_path):
    import onnx
    from onnx import numpy_helper

    _, _, after, rep, _, _ = rounded
    path = tmp_path / "ada.onnx"
    dal.export_onnx(after, (torch.zeros(1, 1, 28, 28),), str(path))
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dq_weights = []
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            arr = inits[node.input[0]]
            if arr.ndim >= 2:
                dq_weights.append(arr.astype(np.int64))
    mods = dict(after.named_modules())
    for row in rep.rows:
        codes = learned_codes(mods[row["layer"]]).to(torch.int64).numpy()
        hits = [a for a in dq_weights if a.shape == codes.shape and np.array_equal(a, codes)]
        assert len(hits) == 1, row["layer"]


def test_adaround_brings_outputs_closer_to_float(rounded):
    net, before, after, _, calib, test = rounded
    x = torch.cat([b[0] for b in test])
    with torch.no_grad():
        ref = net.eval()(x)
        err_nearest = float((before.eval()(x) - ref).pow(2).mean())
        err_learned = float((after(x) - ref).pow(2).mean())
    assert err_learned < err_nearest


def test_unknown_layer_is_named():
    net, calib, _ = _model_and_data()
    q = dal.prepare_qat(net, recipe=W4A8_PER_CHANNEL, hardware="a2000", example_inputs=(torch.zeros(2, 1, 28, 28),))
    dal.calibrate(q, calib, progress=False)
    with pytest.raises(ValueError, match="nope"):
        adaround(q, calib, layers=["nope"], progress=False)


