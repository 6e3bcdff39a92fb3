"""Bad input raises ValueError naming the argument and its value."""
import pytest
import torch

import dal.formats as F

x = torch.randn(4, 6)


@pytest.mark.parametrize("call,match", [
    (lambda: F.fake_quantize(x, "int3", 1.0), r"format='int3'.*known formats: int8"),
    (lambda: F.quantize(x, "nope", 1.0), r"format='nope'"),
    (lambda: F.quantize(x, "int8", 0.0), r"scale must be > 0.*\[0\.0\]"),
    (lambda: F.quantize(x, "int8", -2.0), r"scale must be > 0.*-2\.0"),
    (lambda: F.fake_quantize(x, "int8", float("nan")), r"scale must be finite.*nan"),
    (lambda: F.fake_quantize(x, "int8", float("inf")), r"scale must be finite.*inf"),
    (lambda: F.quantize(x, "int8", 1.0, 200), r"zero_point=\[200\] is out of range for int8 \[-128, 127\]"),
    (lambda: F.quantize(x, "uint4", 1.0, 16), r"zero_point=\[16\] is out of range for uint4"),
    (lambda: F.quantize(x, "uint8", 1.0, 3.5), r"zero_point must be integer.*3\.5"),
    (lambda: F.quantize(x, "fp8_e4m3", 1.0, 1), r"zero_point must be 0 for fp8_e4m3.*1"),
    (lambda: F.quantize(x, "int8", torch.ones(6), granularity=F.per_channel(2)), r"axis=2 is out of range"),
    (lambda: F.quantize(x, "int8", torch.ones(6), granularity=F.per_channel(-3)), r"axis=-3 is out of range"),
    (lambda: F.quantize(x, "int8", torch.ones(4, 2), granularity=F.per_group(1, 4)),
     r"block_size=4 does not divide axis 1 of length 6"),
    (lambda: F.per_group(0, 0), r"group size=0"),
    (lambda: F.quantize(x, "int8", torch.ones(5), granularity=F.per_channel(1)), r"scale has shape \(5,\).*\(6,\)"),
    (lambda: F.quantize(x.long(), "int8", 1.0), r"dtype=torch.int64"),
    (lambda: F.choose_qparams(torch.tensor(1.0), torch.tensor(0.0), "int8"), r"min_val > max_val"),
    (lambda: F.choose_qparams(torch.tensor(float("nan")), torch.tensor(0.0), "int8"), r"non-finite range"),
    (lambda: F.choose_qparams(torch.tensor(0.0), torch.tensor(1.0), "fp16"), r"'fp16' is a plain cast"),
])
def test_bad_input_names_argument_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()
