"""NaN has no integer code (ONNX QuantizeLinear leaves it undefined): the integer model refuses
an input holding NaN with one line naming the input, where it used to map NaN to the zero
point's code and return a plausible, silently wrong result."""
import pytest
import torch

import dal
from convert_common import build
from dal.convert import ConvertError
from dal_examples.zoo import MnistCNN

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def int_model():
    torch.manual_seed(0)
    qat, _, _ = build(MnistCNN(), torch.randn(2, 1, 28, 28), "a2000")
    return dal.convert(qat)


def test_nan_input_is_refused_naming_the_input(int_model):
    x = torch.randn(2, 1, 28, 28)
    ok = int_model(x)
    x[1, 0, 3, 4] = float("nan")
    with pytest.raises(ConvertError, match=r"^integer model: input 0 holds 1 NaN of 1568 elements") as e:
        int_model(x)
    assert "\n" not in str(e.value)
    with pytest.raises(ConvertError, match="input 0 holds 1 NaN"):
        int_model.run_with_codes(x)
    x[1, 0, 3, 4] = 0.0  # the same model still runs clean inputs
    assert int_model(x).shape == ok.shape


def test_nan_inside_the_model_names_the_layer(int_model):
    """A NaN made inside the network (here: an inf input times a zero weight would; forced by
    calling the layer directly) is refused by the integer group that would quantize it."""
    int_model(torch.randn(2, 1, 28, 28))  # the integer groups are planned at the first forward (this test may run alone)
    lay = next(l for p, l in int_model._layers.items() if l.plans and l.plans[0].fused)
    x = torch.zeros(1, 1, 28, 28) if lay.kind == "conv" else torch.zeros(1, lay.w_int.shape[1])
    x.view(-1)[0] = float("nan")
    with pytest.raises(ConvertError, match=rf"{lay.path}: its input holds 1 NaN.*input_quant"):
        lay._integer(x, lay.plans[0])
