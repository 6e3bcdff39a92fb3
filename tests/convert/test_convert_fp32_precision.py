"""dal.convert's exact accumulation stays exact when the user's script lowers torch's float32
precision: under oneDNN's bf16 operand rounding (``fp32_precision = "bf16"``, what
``torch.set_float32_matmul_precision("medium")`` sets for matmuls on the CPU) a float32 product of
16-bit codes is wrong by thousands on CPUs with bf16 units, so ``linear_exact`` / ``conv_exact``
must take their float64 path. Oracle: torch's float64 matmul / conv2d of the same integers (exact:
every sum is an integer below 2^53)."""
import pytest
import torch
import torch.nn.functional as F

from dal.convert.accumulate import chunk_bounds, conv_exact, float32_is_ieee, linear_exact


@pytest.fixture
def lowered(request):
    backend = getattr(torch.backends.mkldnn, request.param)
    before = backend.fp32_precision
    backend.fp32_precision = "bf16"
    yield request.param
    backend.fp32_precision = before


@pytest.mark.parametrize("lowered", ["matmul"], indirect=True)
def test_linear_exact_under_bf16_matmul_precision(lowered):
    assert not float32_is_ieee("matmul")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-32768, 32768, (16, 512), generator=g).float()
    w = torch.randint(-8, 8, (64, 512), generator=g).float()
    acc = linear_exact(x, w, chunk_bounds(w.unsqueeze(2), 32768))
    assert torch.equal(acc, x.double() @ w.double().t())


@pytest.mark.parametrize("lowered", ["conv"], indirect=True)
def test_conv_exact_under_bf16_conv_precision(lowered):
    assert not float32_is_ieee("conv")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-32768, 32768, (2, 32, 9, 9), generator=g).float()
    w = torch.randint(-8, 8, (16, 32, 3, 3), generator=g).float()
    acc = conv_exact(x, w, chunk_bounds(w, 32768), 1, 1, 1, 1)
    assert torch.equal(acc, F.conv2d(x.double(), w.double(), None, 1, 1))


def test_default_precision_is_ieee():
    assert float32_is_ieee("matmul") and float32_is_ieee("conv")
