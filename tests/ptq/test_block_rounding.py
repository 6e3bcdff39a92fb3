"""Block-wise AdaRound (BRECQ, dal.ptq.block_rounding): the blocks found, every weight floor or
ceil of W/s, the block output reconstructed better than round-to-nearest, the learned codes
exported as they are; and the small version of the low-bit PTQ claim of bench/lowbit.py."""
import copy

import numpy as np
import pytest
import torch

import dal
from dal.ptq import adaround, learned_codes
from dal.ptq.block_rounding import find_blocks
from dal.ptq.layers import weighted_layers
from ptq_helpers import W4A8_PER_TENSOR_ALL, ptq, trained_mobilenet

X = (torch.zeros(2, 1, 28, 28),)


def _calibrated(recipe=W4A8_PER_TENSOR_ALL):
    net, cal, tst = trained_mobilenet()
    q = dal.prepare_qat(net, recipe=recipe, hardware="a2000", example_inputs=X)
    dal.calibrate(q, cal, progress=False)
    return q, cal, tst


@pytest.fixture(scope="module")
def rounded():
    """(calibrated W4A8 MobileNetTiny before, after block-wise AdaRound, report)."""
    q, cal, _ = _calibrated()
    before = copy.deepcopy(q)
    rep = adaround(q, cal, iters=150, batch_size=16, block="block", progress=False)
    return before, q, rep


def test_find_blocks_pairs_each_depthwise_with_its_pointwise():
    q, cal, _ = _calibrated()
    names = [n for n, _ in weighted_layers(q, cal)]
    units = find_blocks(q, names)
    assert units[0] == ("stem.0", ["stem.0"]) and units[-1] == ("head", ["head"])
    assert units[1:-1] == [(f"blocks.{i}", [f"blocks.{i}.0", f"blocks.{i}.3"]) for i in range(5)]
    # max_layers=1: no block holds a single layer only, so every layer is fitted alone.
    assert [u for u, _ in find_blocks(q, names, max_layers=1)] == names


def test_find_blocks_takes_each_residual_block_of_a_torchvision_resnet():
    torchvision = pytest.importorskip("torchvision")
    x = [torch.randn(2, 3, 32, 32)]
    q = dal.prepare_qat(torchvision.models.resnet18(weights=None, num_classes=10).eval(),
                        recipe="w4a8_fp8_performance", hardware="a2000", example_inputs=(x[0][:1],))
    dal.calibrate(q, x, progress=False)
    units = dict(find_blocks(q, [n for n, _ in weighted_layers(q, x)]))
    assert list(units) == ["conv1"] + [f"layer{i}.{j}" for i in range(1, 5) for j in (0, 1)] + ["fc"]
    assert units["layer2.0"] == ["layer2.0.conv1", "layer2.0.conv2", "layer2.0.downsample.0"]


def test_every_weight_is_floor_or_ceil_and_quantizers_frozen(rounded):
    before, after, rep = rounded
    b_mods, a_mods = dict(before.named_modules()), dict(after.named_modules())
    assert {r["block"] for r in rep.rows} == {"stem.0", "head"} | {f"blocks.{i}" for i in range(5)}
    for row in rep.rows:
        bm, am = b_mods[row["layer"]], a_mods[row["layer"]]
        w = bm.folded_weight_and_bias()[0] if hasattr(bm, "folded_weight_and_bias") else bm.weight
        s, z = bm.weight_quant.effective_qparams()
        g = bm.weight_quant.granularity
        ratio = w.detach().double() / g.expand(s.double(), w.shape) + g.expand(z.double(), w.shape)
        lo, hi = am.weight_quant.qmin, am.weight_quant.qmax
        codes = learned_codes(am).double()
        ok = (codes == torch.clamp(torch.floor(ratio), lo, hi)) | (codes == torch.clamp(torch.floor(ratio) + 1, lo, hi))
        assert bool(ok.all()), row["layer"]
        assert torch.equal(am.weight_quant.scale, bm.weight_quant.scale) and am.weight_quant.state == "frozen"
    assert max(r["flipped"] for r in rep.rows) > 0.01  # not round-to-nearest everywhere


def test_each_block_output_is_closer_to_float_than_round_to_nearest(rounded):
    _, _, rep = rounded
    for row in rep.rows:
        if row["block"].startswith("blocks."):
            assert row["mse_learned"] < row["mse_nearest"], row


def test_exported_weights_are_the_block_learned_codes(rounded, tmp_path):
    import onnx
    from onnx import numpy_helper

    _, after, rep = rounded
    path = tmp_path / "brecq.onnx"
    dal.export_onnx(after, (torch.zeros(1, 1, 28, 28),), str(path))
    m = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    dq = [inits[n.input[0]].astype(np.int64) for n in m.graph.node
          if n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].ndim >= 2]
    mods = dict(after.named_modules())
    for row in rep.rows:
        codes = learned_codes(mods[row["layer"]]).to(torch.int64).numpy()
        assert sum(a.shape == codes.shape and np.array_equal(a, codes) for a in dq) >= 1, row["layer"]


def _constructed_mobilenet(train):
    """MobileNetTiny(8) built, not trained: seeded weights, and BatchNorm statistics set from
    ``train``'s images in float64 (cumulative average) before the cast back to float32, so the
    net is the same on every CPU. Trained nets are not: float32 training on an AMD host gave a
    net that lost only 3.9 points under min-max W4A8, not the hard case this claim needs."""
    from dal_examples.zoo import MobileNetTiny

    torch.manual_seed(0)
    net = MobileNetTiny(8).double()
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None
    net.train()
    with torch.no_grad():
        for x, _ in train:
            net(x.double())
    return net.float().eval()


@pytest.mark.slow
def test_adaround_and_bias_correction_recover_what_min_max_w4a8_loses():
    """The small version of bench/lowbit.py's claim: per-tensor INT4 weights on a depthwise net
    with BN folded; min-max changes many of the float net's predictions, AdaRound + bias
    correction win most of them back. Scored against the float net run in float64: top-1
    agreement, and the output error relative to the outputs' spread over the images."""
    from ptq_helpers import mnist_batches

    train, cal, tst = mnist_batches(n_train=1024)
    net = _constructed_mobilenet(train)
    x = torch.cat([b[0] for b in tst])
    with torch.no_grad():
        ref = copy.deepcopy(net).double()(x.double())

    def scores(model) -> tuple[float, float]:
        with torch.no_grad():
            y = model.eval()(x).double()
        err = float((y - ref).pow(2).sum() / (ref - ref.mean(0)).pow(2).sum())
        return float((y.argmax(1) == ref.argmax(1)).double().mean()), err

    mm_agree, mm_err = scores(ptq(net, W4A8_PER_TENSOR_ALL, cal))
    ada_agree, ada_err = scores(ptq(net, W4A8_PER_TENSOR_ALL, cal, ("adaround", "bias_correction"),
                                    adaround_args={"iters": 200, "batch_size": 16}))
    # measured (2026-12-05): min-max agrees on 89.3% (error 1.34), AdaRound + BC on 98.0% (0.45)
    assert mm_agree < 0.95, mm_agree  # the case is a hard one, else the next lines prove nothing
    assert 1 - ada_agree <= 0.5 * (1 - mm_agree), (mm_agree, ada_agree)
    assert ada_err <= 0.5 * mm_err, (mm_err, ada_err)


def test_bad_block_arguments_are_named():
    q, cal, _ = _calibrated()
    with pytest.raises(ValueError, match="block='brick'"):
        adaround(q, cal, block="brick", progress=False)
    with pytest.raises(ValueError, match="nope"):
        adaround(q, cal, block="block", blocks=["nope"], progress=False)
