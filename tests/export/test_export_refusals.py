"""Parameters an ONNX file cannot hold are refused by name, never written as something else."""
import pytest
import torch

import dal
from dal.export import ExportError
from dal.prepare.state import quantizers, set_quantizer_state
from dal_examples.zoo import MnistCNN


def _frozen():
    torch.manual_seed(0)
    x = torch.randn(2, 1, 28, 28)
    m = dal.prepare_qat(MnistCNN(), "int8_balanced", hardware="a2000", example_inputs=(x,), quantize_outputs=True)
    dal.calibrate(m, [torch.randn(2, 1, 28, 28)], progress=False)
    set_quantizer_state(m, "frozen")
    return m.eval(), x


@pytest.mark.parametrize("value", [float("nan"), 0.0, -0.1, float("inf")])
def test_bad_scale_is_refused_naming_the_quantizer(value):
    m, x = _frozen()
    dict(quantizers(m))["head.input_quant"].scale.fill_(value)
    with pytest.raises(ExportError, match=r"head\.input_quant: scale .* not finite and positive"):
        dal.export_onnx(m, (x,))


def test_zero_point_outside_the_format_is_refused():
    m, x = _frozen()
    dict(quantizers(m))["head.output_quant"].zero_point.fill_(1000)  # uint8: would wrap to 232
    with pytest.raises(ExportError, match=r"head\.output_quant: zero point \[1000\.0\] is outside uint8"):
        dal.export_onnx(m, (x,))


def test_nan_weight_is_refused():
    m, x = _frozen()
    with torch.no_grad():
        m.get_submodule("head").weight[0, 0] = float("nan")
    with pytest.raises(ExportError, match=r"1 weight value\(s\) of head are NaN or infinite"):
        dal.export_onnx(m, (x,))


def test_all_offenders_in_one_error():
    m, x = _frozen()
    qs = dict(quantizers(m))
    qs["head.input_quant"].scale.fill_(0.0)
    qs["head.output_quant"].zero_point.fill_(-5)
    with pytest.raises(ExportError) as err:
        dal.export_onnx(m, (x,))
    assert "head.input_quant" in str(err.value) and "head.output_quant" in str(err.value)


def test_a_learned_scale_gone_nan_is_named():
    fq = dal.FakeQuantizer("int8", learnable=True, name="blk.input_quant")
    fq(torch.randn(64))
    fq.end_observation("quantize")
    with torch.no_grad():
        fq.scale.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"blk\.input_quant: the learned scale is not finite"):
        fq(torch.randn(64))
