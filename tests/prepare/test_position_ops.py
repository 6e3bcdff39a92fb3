"""Position arithmetic (dal.prepare.position_ops): ops computed from integer positions get no
quantizer; the same ops on activations still do."""
import torch
from torch import nn

import dal


class Rotary(nn.Module):
    """The shape of transformers' rotary embedding: x is read for its device and dtype only."""

    def __init__(self, dim=8):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq[None, None, :].to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class UsesTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.rotary = nn.Linear(8, 8), Rotary()

    def forward(self, x, position_ids):
        cos, sin = self.rotary(x, position_ids)
        h = self.fc(x)
        return h * cos + h * sin  # activation x table: quantized


class CastsItsInput(nn.Module):
    """Casts the activation (its first argument) to float: still activation data."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale):
        h = self.fc(x).float()
        return h * h + scale.float() * h


def _rows(model):
    return {r.name: r for r in dal.prepared(model).report.rows}


def test_rotary_tables_get_no_quantizer():
    p = dal.prepare_qat(UsesTables(), recipe="int8_balanced", hardware="a2000")
    rows = _rows(p)
    table_ops = [r for n, r in rows.items() if n.startswith("rotary.") and r.op_class in ("mul", "cat")]
    assert {r.op_class for r in table_ops} == {"mul", "cat"}
    assert all(r.status == "float" and "position arithmetic" in r.detail for r in table_ops)
    assert [rows[n].status for n in ("mul", "mul_1", "add")] == ["quantized"] * 3  # activation x table
    x, pos = torch.randn(2, 5, 8), torch.arange(5).expand(2, 5)
    dal.calibrate(p, [((x, pos), None)], progress=False)
    assert torch.isfinite(p(x, pos)).all()


def test_cast_activation_is_still_quantized():
    p = dal.prepare_qat(CastsItsInput(), recipe="int8_balanced", hardware="a2000")
    functional = [r for n, r in _rows(p).items() if r.op_class in ("mul", "add")]
    assert len(functional) == 3 and all(r.status == "quantized" for r in functional)
