"""An exact sum that leaves int32 on a 32-bit accumulator: dal.npu refuses the file at that group,
and the integer model refuses too, naming the layer (it used to saturate silently)."""
import re

import pytest
import torch
from torch import nn

import dal
import dal.npu
from dal.convert.errors import ConvertError
from dal.npu.errors import NPUError
from export_common import prepared

torch.set_num_threads(1)


def test_int32_overflow_refused_by_both_with_the_same_count():
    torch.manual_seed(0)
    x = torch.rand(2, 3, 8, 8)
    qat = prepared(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 1)), x,
                   "int8_balanced", "a2000")
    conv = qat.get_submodule("0")
    with torch.no_grad():  # a bias code 2000 below 2^31 - 1: accumulators of a few thousand pass it
        conv.bias[1] = float(2 ** 31 - 2000) * float(conv.bias_scale()[1])
    proto = dal.export_onnx(qat, (x,))
    sess = dal.npu.load(proto, threads=1)
    with pytest.raises(NPUError) as npu_err:
        sess.run({sess.input_names[0]: x.numpy()})
    with pytest.raises(ConvertError) as err:
        dal.convert(qat)(x)
    text = str(err.value)
    assert text.startswith("0: accumulator plus bias overflows int32") and "channels 1)" in text, text
    count = re.search(r"at (\d+) of (\d+) outputs", str(npu_err.value)).groups()
    assert re.search(r"at (\d+) of (\d+) outputs", text).groups() == count and int(count[0]) > 0
    # inputs whose sums stay inside int32 run, on both (a zero image: every code at the zero point)
    z = torch.zeros(2, 3, 8, 8)
    assert (dal.convert(qat)(z).numpy() == sess.run({sess.input_names[0]: z.numpy()})[0]).all()
