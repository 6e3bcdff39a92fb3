"""A prepared nn.TransformerEncoder never takes torch's fused eval path past its quantizers.

In eval, a stock TransformerEncoderLayer runs ``torch._transformer_encoder_layer_fwd``, which
reads its Linear weights directly: calibration in eval left linear1 / linear2's quantizers unseen
(turned off), freezing said "has no scale yet", and dal.verify stopped on "'LayerNormForm' object
has no attribute 'eps'". prepare gives each such layer a no-op forward pre-hook (dal.nn.fast_path),
which torch's own check reads as "hooks attached", per module, never process-wide.
"""
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import dal
from dal.nn.fast_path import module_path_only

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "int8_balanced.yaml"


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), torch.randn(2, 8, 32)


def _quantizers(model):
    return {n: q for n, q in model.named_modules() if type(q).__name__ == "FakeQuantizer"}


def test_prepared_layers_are_hooked_and_compute_the_module_path():
    model, x = _encoder()
    with torch.no_grad():
        ref = model(x)  # torch's fused path: its result, to compare the module path against
    qat = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    for layer in qat.layers:
        assert module_path_only in layer._forward_pre_hooks.values()
    dal.prepare.set_quantizer_state(qat, "off")
    with torch.no_grad():
        got = qat.eval()(x)  # quantizers off: the module path computes the fused path's numbers
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("replace", [[], ["npu_attention", "layernorm_fp16"]])
def test_calibrated_in_eval_every_quantizer_saw_data_and_verifies(replace):
    model, x = _encoder()
    recipe = dict(yaml.safe_load(RECIPE.read_text()), replace=replace)
    qat = dal.prepare_qat(model, recipe=recipe, hardware="a2000", example_inputs=(x,)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        dal.calibrate(qat, [torch.randn(x.shape, generator=g) for _ in range(2)], progress=False)
    off = [n for n, q in _quantizers(qat).items() if q.state == "off"]
    assert not off, off  # calibrate turns off the quantizers that saw no data
    assert all(q.initialized for n, q in _quantizers(qat).items() if q.fmt.is_integer)
    report = dal.verify(dal.export_onnx(qat, (x,)), qat, (x,), onnxruntime=False)
    parity = report.integer
    assert parity.error is None and parity.codes > 0 and parity.codes_differ == 0, parity
    if replace:  # every op an NPU op: the integer model == dal.npu on every element, outputs included
        assert parity.identical, parity
