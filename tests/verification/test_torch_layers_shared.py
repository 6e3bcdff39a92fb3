"""dal.verify's torch view (torch_layers) compares and pins a QGridSample's output, which the layer
requantizes on its input quantizer's scale and zero point without calling that quantizer
(dal.nn.grid_sample.SharedRequant): in the file it is the quantizer's second QuantizeLinear.

Oracle: the NPU reference's codes of that QuantizeLinear (dal.npu reads only the file); a
deliberately wrong torch output at that point must show up as a differing row, and be pinned (the
next layer's row does not see it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.nn.grid_sample import QGridSample


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        g = torch.rand(1, 6, 7, 2, generator=torch.Generator().manual_seed(0)) * 2.4 - 1.2
        self.register_buffer("grid", g)

    def forward(self, x):
        return self.c2(F.grid_sample(self.c1(x), self.grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    torch.manual_seed(0)
    x = torch.randn(1, 3, 10, 12)
    p = dal.prepare_qat(_Net(), recipe="int8_balanced", hardware="a2000")
    dal.calibrate(p, [x, torch.randn(1, 3, 10, 12)], progress=False)
    p.eval()
    path = str(tmp_path_factory.mktemp("gs") / "m.onnx")
    dal.export_onnx(p, (x,), path)
    return p, path, x


def _layer(p) -> QGridSample:
    return next(m for m in p.modules() if isinstance(m, QGridSample))


def test_output_requantization_holds_no_state(flow):
    p, _, _ = flow
    q = _layer(p)
    assert not list(q.output_requant.parameters()) and not list(q.output_requant.buffers())
    assert not any("output_requant" in k for k in p.state_dict())


def test_grid_sample_output_is_compared_and_pinned(flow):
    p, path, x = flow
    q = _layer(p)
    report = dal.verify(path, p, (x,))
    assert report.verdict(), report.verdict_line()
    base = q.qat_name + ".input_quant"
    rows = {r.node: r for r in report.torch_layers}
    out_node = f"{base}/QuantizeLinear_1"
    assert out_node in rows and rows[out_node].differ == 0  # compared: torch's output codes == the NPU's
    # one wrong output code in torch: the row shows it, and the pinned value keeps it out of c2's row
    scale = float(q.input_quant.scale)

    def nudge(mod, args, out):
        out = out.clone()
        out.view(-1)[5] += 3 * scale
        return out
    h = q.output_requant.register_forward_hook(nudge)
    try:
        bad = dal.verify(path, p, (x,))
    finally:
        h.remove()
    rows = {r.node: r for r in bad.torch_layers}
    assert rows[out_node].differ == 1 and rows[out_node].max_abs == 3 and not bad.verdict()
    after = [r for n, r in rows.items() if n != out_node]
    assert after and all(r.differ == 0 for r in after)
