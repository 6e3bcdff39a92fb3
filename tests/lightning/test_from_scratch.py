"""QAT from random weights learns: the Lightning callback with ``example_inputs`` (which used to
put a uint8 quantizer on the logits, calibrated to the untrained model's tiny range, that training
could never widen: 8% accuracy) reaches the float run's accuracy within 2 points, on real MNIST.

Both runs start from the same random weights and see the same batches in the same order; the
float run is the peer measured here, not a stored number."""
import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from lit_common import LitMnist, mnist_subset, trainer  # noqa: E402

import dal  # noqa: E402
from dal.recipe import RecipeError  # noqa: E402
from dal_examples.zoo import MnistCNN  # noqa: E402

pytestmark = pytest.mark.slow


def _fit_and_test(tmp_path, name, callbacks=()):
    torch.manual_seed(3)
    lit = LitMnist(width=16, lr=0.05, pretrained=False)
    train, test = mnist_subset(n_train=6400, n_test=2000)
    t = trainer(tmp_path, name, max_epochs=1, callbacks=callbacks)
    t.fit(lit, train)
    return t.test(lit, test, verbose=False)[0]["test_acc"] * 100, lit


def test_qat_from_scratch_with_example_inputs_matches_float(tmp_path):
    from dal.lightning import QATCallback

    x = mnist_subset(n_train=4, n_test=4)[1].dataset.tensors[0][:4]
    float_acc, _ = _fit_and_test(tmp_path, "float")
    qat = QATCallback(recipe="int8_balanced", hardware="a2000", calibrate_batches=4, example_inputs=(x,))
    qat_acc, lit = _fit_and_test(tmp_path, "qat", callbacks=[qat])
    assert float_acc > 85, f"the float baseline did not learn ({float_acc:.1f}%): the comparison means nothing"
    assert qat_acc >= float_acc - 2, f"QAT from scratch {qat_acc:.1f}% vs float {float_acc:.1f}%"
    # The logits feed the loss: no quantizer on them, and the report says so.
    assert lit.model.head.output_quant is None
    assert any("model outputs left in float: head" in n for n in dal.prepared(lit.model).report.notes)


def test_quantize_outputs_recipe_key_adds_the_output_quantizer():
    x = torch.randn(2, 1, 28, 28)
    recipe = dal.load_recipe("int8_balanced").to_dict()
    plain = dal.prepare_qat(MnistCNN(), recipe=recipe, hardware="a2000", example_inputs=(x,))
    assert plain.head.output_quant is None
    asked = dal.prepare_qat(MnistCNN(), recipe={**recipe, "quantize_outputs": True}, hardware="a2000",
                            example_inputs=(x,))
    assert isinstance(asked.head.output_quant, dal.FakeQuantizer)
    assert "output quantizer added to head" in "\n".join(dal.prepared(asked).report.notes)
    assert dal.load_recipe({**recipe, "quantize_outputs": True}).to_dict()["quantize_outputs"] is True


def test_quantize_outputs_must_be_a_boolean():
    recipe = dal.load_recipe("int8_balanced").to_dict()
    with pytest.raises(RecipeError, match="quantize_outputs"):
        dal.load_recipe({**recipe, "quantize_outputs": "yes"})
