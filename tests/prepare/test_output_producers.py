"""The layers producing a model's outputs, found before apply from the float forward
(dal.prepare.example_run): which op returns each output is known here by construction of the
model, not read from dal. With ``quantize_outputs=True`` exactly those get an output quantizer."""
import inspect

import torch
from torch import nn

import dal
from dal.quantizer import quantizers


class Branchy(nn.Module):
    """A forward fx cannot trace (a branch on a value): its last ``+`` is found by call site."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > -1e9:
            y = y + self.b(x)
        return y


class TwoOutputs(nn.Module):
    """A traced forward returning a tuple: a quantized ``+`` and a Linear's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x) + self.b(x), self.c(x)


def _outputs_quantized(q) -> list[str]:
    return sorted(n.rpartition(".output_quant")[0] for n, _ in quantizers(q) if n.endswith(".output_quant"))


def test_a_call_site_add_that_returns_the_output_gets_the_output_quantizer():
    q = dal.prepare_qat(Branchy(), "int8_balanced", hardware="a2000", example_inputs=(torch.randn(4, 8),),
                        quantize_outputs=True)
    lines, first = inspect.getsourcelines(Branchy.forward)
    line = first + next(i for i, text in enumerate(lines) if "y = y + self.b(x)" in text)
    assert _outputs_quantized(q) == [f"dal_sites.add_l{line}_0"]


def test_each_element_of_a_returned_tuple_has_its_own_producer():
    q = dal.prepare_qat(TwoOutputs(), "int8_balanced", hardware="a2000", example_inputs=(torch.randn(4, 8),),
                        quantize_outputs=True)
    assert _outputs_quantized(q) == ["add", "c"]
    assert "output quantizer added to add, c " in "\n".join(dal.prepared(q).report.notes)


def test_a_layer_whose_output_is_freed_is_no_output_producer():
    """nn.TransformerEncoderLayer returns ``norm2(x + linear2(...))``: LayerNorm (float on the
    a2000's FP16 engine) produces the output, not linear2, whose output tensor is freed before the
    output is allocated (a match by ``id()`` alone could mistake one for the other)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    q = dal.prepare_qat(enc, "int8_balanced", hardware="a2000", example_inputs=(torch.randn(1, 4, 16),),
                        quantize_outputs=True)
    assert _outputs_quantized(q) == []
    assert not any("output quantizer added" in n for n in dal.prepared(q).report.notes)
