"""RMSNorm recognised by what it computes (dal.replace.rmsnorm), and its FP16 form against torch.

Oracles: torch's ``nn.RMSNorm`` / ``F.rms_norm`` and float64 arithmetic; transformers' own
RMSNorm classes are recognised without dal listing them.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import dal  # noqa: E402
from dal.replace.rmsnorm import Fp16RMSNorm, rmsnorm_eps  # noqa: E402

F32_EPS = float(torch.finfo(torch.float32).eps)


class MeanSubtractingNorm(nn.Module):
    """A LayerNorm without bias, written by hand: not an RMSNorm."""

    def __init__(self, c, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(c)), eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MislabelledEps(nn.Module):
    """Computes an RMSNorm with eps 1e-5 but stores 0.1: no candidate eps reproduces it."""

    def __init__(self, c):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(c) + 0.5), 0.1

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class HandRMSNorm(MislabelledEps):
    def __init__(self, c, eps):
        super().__init__(c)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_torch_rmsnorm():
    assert rmsnorm_eps(nn.RMSNorm(64)) == F32_EPS
    assert rmsnorm_eps(nn.RMSNorm(64, eps=1e-6)) == 1e-6
    assert rmsnorm_eps(nn.RMSNorm((4, 16))) is None  # two normalised dimensions
    assert rmsnorm_eps(nn.LayerNorm(64)) is None


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_by_computation_not_by_class(eps):
    assert rmsnorm_eps(HandRMSNorm(64, eps)) == eps
    assert rmsnorm_eps(MeanSubtractingNorm(64)) is None
    assert rmsnorm_eps(MislabelledEps(64)) is None


def test_transformers_classes():
    T = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    assert T is not None
    for cls in (LlamaRMSNorm, Qwen2RMSNorm, T5LayerNorm):
        assert rmsnorm_eps(cls(64, eps=1e-6)) == 1e-6, cls
    assert rmsnorm_eps(GemmaRMSNorm(64, eps=1e-6)) is None  # scales by (1 + weight): another function


def _half_bits(t):
    return t.detach().half().view(torch.int16).to(torch.int32)


def test_fp16_form_against_torch():
    """Quantizing: output within 1 fp16 LSB of the fp16 rounding of torch's float64 RMSNorm of
    the fp16-rounded input times the fp16-rounded weight (the one rounding of float32 in between
    may cross an fp16 tie); observe state (before calibration): torch's float RMSNorm."""
    torch.manual_seed(0)
    ref = nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(64) * 2 - 0.5)
    x = torch.randn(4, 16, 64) * 3 + 0.5
    q = Fp16RMSNorm.from_module(ref, "norm")
    assert q.weight is ref.weight and q.rms_eps == 1e-6
    torch.testing.assert_close(q(x), ref(x), rtol=1e-6, atol=1e-6)  # quantizers observe: identities
    dal.set_quantizer_state(q, "quantize")
    xh, wh = x.half().double(), ref.weight.detach().half().double()
    want = (xh * torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + 1e-6) * wh).half()
    got = q(x)
    assert got.dtype == torch.float32 and torch.equal(got, got.half().float())  # fp16 values
    diff = (_half_bits(got) - _half_bits(want)).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) > 0.99
    got.sum().backward()
    assert ref.weight.grad is not None and torch.isfinite(ref.weight.grad).all()


def test_to_float_gives_the_module_back():
    T = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert T is not None
    m = LlamaRMSNorm(32, eps=1e-5)
    back = Fp16RMSNorm.from_module(m, "n").to_float()
    assert type(back) is LlamaRMSNorm and back.weight is m.weight and "rms_eps" not in vars(back)
    assert not any(isinstance(c, dal.FakeQuantizer) for c in back.modules())
    with pytest.raises(ValueError, match="does not compute an RMSNorm"):
        Fp16RMSNorm.from_module(MeanSubtractingNorm(8), "x")


def test_export_and_npu_parity(tmp_path):
    """The FP16 RMSNorm exports (its formula between fp16 Casts: no aten::rms_norm below opset
    23) and the integer model equals dal.npu on every element (dal.verify's verdict)."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm, self.fc2 = nn.Linear(64, 64), nn.RMSNorm(64, eps=1e-6), nn.Linear(64, 64)

        def forward(self, x):
            return self.fc2(self.norm(self.fc(x)))

    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    p = dal.prepare_qat(Block(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    assert type(p.norm) is Fp16RMSNorm
    dal.calibrate(p, [x, torch.randn(2, 8, 64)], progress=False)
    path = tmp_path / "rms.onnx"
    dal.export_onnx(p, (x,), str(path))
    import onnx

    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert {"Pow", "ReduceMean", "Sqrt", "Cast"} <= set(ops)
    rep = dal.verify(str(path), p, (x,))
    assert rep.verdict() and rep.meets_criterion(), rep.verdict_line()
