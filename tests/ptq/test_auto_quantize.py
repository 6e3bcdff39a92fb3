"""dal.auto_quantize: the ladder stops at the first rung within max_drop, falls back layer by
layer, hands back a QAT model; bad eval_fn / max_drop are named and lose nothing."""
import copy
import math

import pytest
import torch

import dal
from dal.ptq import AutoQuantizeError
from ptq_helpers import W4A8_PER_CHANNEL, accuracy, mnist_cnn


@pytest.fixture(scope="module")
def mnist():
    return mnist_cnn()


def test_stops_at_the_first_rung_within_max_drop(mnist):
    net, calib, test = mnist
    res = dal.auto_quantize(net, calib, lambda m: accuracy(m, test), max_drop=5.0, hardware="a2000",
                            recipe="int8_balanced", progress=False)
    assert [r.name for r in res.rungs] == ["min-max"] and res.status == "ptq"
    assert res.float_metric == accuracy(net, test)  # measured by the same eval_fn
    assert res.rungs[0].metric == accuracy(res.model, test)
    # The recipe is committable: YAML that loads back to the same recipe.
    import yaml

    assert dal.load_recipe(yaml.safe_load(res.recipe_yaml)) == res.recipe
    assert res.recipe.calibration.method == "minmax"
    text = str(res)
    assert "min-max" in text and "#" in text  # the table with its bars
    assert 'id="auto-quantize"' in res.to_html() and "min-max" in res.to_html()


def test_unreachable_drop_climbs_everything_and_hands_back_qat(mnist):
    net, calib, test = mnist
    before = {k: v.clone() for k, v in net.state_dict().items()}
    # A metric that no quantized model can match: only the float model scores 1.
    calls = []

    def metric(m):
        calls.append(1)
        return 1.0 if not any(True for _ in dal.quantizer.quantizers(m)) else accuracy(m, test[:1]) / 200.0

    res = dal.auto_quantize(net, calib[:2], metric, max_drop=0.0, hardware="a2000", recipe=W4A8_PER_CHANNEL,
                            progress=False, max_layers=1, adaround_args={"iters": 20})
    names = [r.name for r in res.rungs]
    assert names[:6] == ["min-max", "percentile", "kl", "mse", "easyquant", "equalize+adaround+bias_correction"]
    assert any(n.startswith("fallback ") and n.endswith("-> int8") for n in names)  # INT4 -> INT8 first
    assert res.status == "qat" and res.model.training
    assert all(q.state == "quantize" for _, q in dal.quantizer.quantizers(res.model))
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # float model untouched
    with pytest.raises(AutoQuantizeError, match="no rung met max_drop=0.0") as err:
        dal.auto_quantize(net, calib[:2], metric, max_drop=0.0, hardware="a2000", recipe=W4A8_PER_CHANNEL,
                          progress=False, max_layers=0, on_miss="raise", adaround_args={"iters": 5})
    assert err.value.result is not None and err.value.result.status == "qat"


@pytest.mark.parametrize("bad, match", [
    (lambda m: 1 / 0, "eval_fn <lambda> raised ZeroDivisionError"),
    (lambda m: math.nan, "returned nan"),
    (lambda m: "97%", "returned str '97%'"),
    (lambda m: True, "returned bool"),
])
def test_bad_eval_fn_is_named(mnist, bad, match):
    net, calib, _ = mnist
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(AutoQuantizeError, match=match):
        dal.auto_quantize(net, calib, bad, max_drop=1.0, hardware="a2000", progress=False)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_eval_fn_failing_on_a_rung_names_the_rung(mnist):
    net, calib, _ = mnist

    def metric(m):
        if any(True for _ in dal.quantizer.quantizers(m)):
            raise RuntimeError("out of memory")
        return 0.9

    with pytest.raises(AutoQuantizeError, match="rung 'min-max'.*float model is unchanged"):
        dal.auto_quantize(net, calib, metric, max_drop=1.0, hardware="a2000", progress=False)


@pytest.mark.parametrize("drop", [-0.1, math.inf, "1", None])
def test_bad_max_drop(mnist, drop):
    net, calib, test = mnist
    with pytest.raises(ValueError, match="max_drop"):
        dal.auto_quantize(net, calib, lambda m: 1.0, max_drop=drop, hardware="a2000", progress=False)
