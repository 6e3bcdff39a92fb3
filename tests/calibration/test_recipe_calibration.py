"""calibrate(method=None) does what the model's recipe says in its calibration: section."""
import pytest
import torch

import dal
from dal.prepare.state import quantizers
from dal_examples.zoo import MnistCNN


def _model(calibration: dict):
    rec = dal.load_recipe("int8_balanced").to_dict()
    rec["name"], rec["calibration"] = "cal", calibration
    torch.manual_seed(0)
    return dal.prepare_qat(MnistCNN(), rec, hardware="a2000", example_inputs=(torch.zeros(1, 1, 28, 28),))


def _scales(model):
    return {n: q.scale.clone() for n, q in quantizers(model)}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 1, 28, 28, generator=g) for _ in range(2)] + [100 * torch.ones(4, 1, 28, 28)]


def test_recipe_method_and_args_are_used():
    by_recipe = _model({"method": "percentile", "num_batches": 8, "args": {"percentile": 90.0}})
    dal.calibrate(by_recipe, _batches()[:2], progress=False)
    explicit = _model({"method": "minmax"})
    dal.calibrate(explicit, _batches()[:2], progress=False, method="percentile", percentile=90.0)
    observers = _model({"method": "minmax"})
    dal.calibrate(observers, _batches()[:2], progress=False)
    a, b, c = _scales(by_recipe), _scales(explicit), _scales(observers)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "input" in k)  # the 90th percentile clips


def test_recipe_num_batches_bounds_the_data():
    one = _model({"method": "minmax", "num_batches": 2})
    dal.calibrate(one, _batches(), progress=False)  # the third (outlier) batch is not seen
    ref = _model({"method": "minmax"})
    dal.calibrate(ref, _batches()[:2], progress=False, method="minmax")
    a, b = _scales(one), _scales(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_observer_calibration_refuses_method_arguments():
    with pytest.raises(TypeError, match=r"takes no method arguments, got \['percentile'\]"):
        dal.calibrate(_model({"method": "minmax"}), _batches()[:1], progress=False, percentile=99.0)
