"""A softmax in a forward torch.fx cannot trace (Deformable-DETR's ``MSDeformAttn``: the attention
weights' ``F.softmax``) runs as the hardware model declares, like a traced one (issue 44): an FP16
island on the a2000 (its softmax op class takes fp16 only, its vector engine computes in fp16),
a refusal naming the layer on the a1000 (no FP16 engine) unless a recipe rule keeps it off the NPU.

Oracles: torch's own softmax in float64 of the fp16-rounded logits (the island's numbers), the
exported graph's node sequence (export/SPEC.md §6's island form), dal.verify's verdict (dal.npu
from the file == dal.convert on every element, onnxruntime with optimizations off layer by layer,
differing codes only near float16 / float32 ties)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto

import dal
from dal.prepare.fp16_island import Fp16Function
from dal.recipe.errors import RecipeError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bev_block import MSDeformAttn  # noqa: E402  (the MSDA reference, examples/bev/bev_deform.py's)

torch.set_num_threads(1)
SHAPES = ((4, 4), (2, 2))
D_MODEL = 16


class Block(torch.nn.Module):
    """MSDeformAttn as the BEV block calls it (level shapes a buffer, so its forward iterates over
    a tensor: fx cannot trace it and prepare captures its calls by call site)."""

    def __init__(self):
        super().__init__()
        self.attn = MSDeformAttn(D_MODEL, len(SHAPES))
        self.register_buffer("shapes", torch.tensor(SHAPES))

    def forward(self, query, ref, value):
        return self.attn(query, ref, value, self.shapes)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    n_in = sum(h * w for h, w in SHAPES)
    return (torch.randn(1, 6, D_MODEL, generator=g), torch.rand(1, 6, len(SHAPES), 2, generator=g),
            torch.randn(1, n_in, D_MODEL, generator=g))


@pytest.fixture(scope="module")
def island():
    """(prepared, calibrated, one QAT step, eval) Block on the a2000 with int8_balanced, inputs."""
    torch.manual_seed(0)
    x = _inputs(0)
    p = dal.prepare_qat(Block(), recipe="int8_balanced", hardware="a2000", example_inputs=x)
    dal.calibrate(p, [x, _inputs(1)], progress=False, input_fn=lambda b: (b, {}))
    p.train()
    p(*x).square().mean().backward()
    torch.optim.SGD(p.parameters(), lr=0.01).step()
    return p.eval(), x


def _softmax_site(p):
    sites = {k: m for k, m in p.attn.dal_sites.items() if k.startswith("softmax_l")}
    assert len(sites) == 1, list(p.attn.dal_sites)
    return next(iter(sites.items()))


def test_call_site_softmax_is_an_fp16_island_on_the_a2000(island):
    """The report row and the module: ``attn.dal_sites.softmax_l<line>_0`` is an Fp16Function of op
    class softmax, status fp16, with its source line; its output is torch's float64 softmax of the
    fp16-rounded logits, rounded to fp16 (at most one fp16 rounding apart: float32 vs float64)."""
    p, x = island
    key, mod = _softmax_site(p)
    assert isinstance(mod, Fp16Function) and mod.op_class == "softmax"
    row = next(r for r in dal.prepared(p).report.rows if r.name == f"attn.dal_sites.{key}")
    assert row.status == "fp16" and row.type_name == "Fp16Function(softmax)" and "bev_deform.py:" in row.detail, row
    seen = {}
    h = mod.register_forward_hook(lambda m, a, out: seen.update(x=a[0].detach(), y=out.detach()))
    try:
        with torch.no_grad():
            p(*x)
    finally:
        h.remove()
    y, logits = seen["y"], seen["x"]
    assert torch.equal(y, y.half().float())  # fp16 values
    ref = F.softmax(logits.half().double(), -1)
    assert (y.double() - ref).abs().max().item() <= 2.0 ** -11 * ref.abs().max().item() + 2.0 ** -24
    assert (y.double() - ref.half().double()).ne(0).float().mean().item() < 0.01  # ties only


def test_export_holds_the_section_6_island_and_verifies(island, tmp_path):
    """export/SPEC.md §6: ``Cast(FLOAT16) -> Cast(FLOAT) -> Softmax -> Cast(FLOAT16) -> Cast(FLOAT)``,
    then the weighted sum's int16 QuantizeLinear; dal.verify: the integer model equals dal.npu on
    every element, onnxruntime agrees layer by layer (near-ties only)."""
    p, x = island
    path = str(tmp_path / "msda.onnx")
    proto = dal.export_onnx(p, x, path)
    nodes = list(proto.graph.node)
    made_by = {o: n for n in nodes for o in n.output}
    (soft,) = [n for n in nodes if n.op_type == "Softmax"]
    to = {n.name: next((a.i for a in n.attribute if a.name == "to"), None) for n in nodes}
    up = made_by[soft.input[0]]
    assert up.op_type == "Cast" and to[up.name] == TensorProto.FLOAT
    assert made_by[up.input[0]].op_type == "Cast" and to[made_by[up.input[0]].name] == TensorProto.FLOAT16
    users = {i: n for n in nodes for i in n.input}
    down = users[soft.output[0]]
    assert down.op_type == "Cast" and to[down.name] == TensorProto.FLOAT16
    assert users[down.output[0]].op_type == "Cast" and to[users[down.output[0]].name] == TensorProto.FLOAT
    rep = dal.verify(path, p, x)
    assert rep.integer is not None and rep.integer.identical, rep.verdict_line()
    assert rep.verdict(), rep.verdict_line()


def test_traced_and_call_site_softmax_islands_compute_alike():
    """A traced ``F.softmax`` (fx traces the forward) and the same call in a forward fx cannot
    trace become the same island: equal outputs on the same calibrated logits."""

    class Traced(torch.nn.Module):
        def forward(self, a):
            return F.softmax(a, -1)

    class Untraced(torch.nn.Module):
        def forward(self, a):
            n = int(a.shape[0])  # int() of a Proxy: fx cannot trace this forward
            return F.softmax(a[:n], dim=-1)

    a = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 4
    outs = []
    for cls in (Traced, Untraced):
        p = dal.prepare_qat(cls(), recipe="int8_balanced", hardware="a2000", example_inputs=(a,))
        assert any(isinstance(m, Fp16Function) for m in p.modules()), cls.__name__
        dal.calibrate(p, [a], progress=False)
        outs.append(p.eval()(a))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[1], F.softmax(a, -1))  # rounded to fp16, not the float32 softmax


def test_a1000_refuses_the_call_site_softmax_by_path():
    """No FP16 engine on the a1000: a call-site softmax that no rule keeps off the NPU is refused
    naming its path (with the grid_samples the a1000 lacks); int8_balanced's ``softmax: fallback
    fp16`` rule keeps it off the NPU instead, listed with that reason."""
    a8 = {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}
    recipe = {"name": "no_softmax_rule", "rules": [
        {"type": "linear", "weight": {"format": "int8", "symmetric": True}, "input": a8},
        {"type": ["add", "mul"], "input": a8}]}
    x = _inputs(0)
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(Block(), recipe=recipe, hardware="a1000", example_inputs=x)
    text = str(err.value)
    assert "attn.dal_sites.softmax_l" in text and "cannot run" in text, text
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(Block(), recipe="int8_balanced", hardware="a1000", example_inputs=x)
    assert "attn.dal_sites.softmax_l" not in str(err.value)  # kept off the NPU by its rule, not refused
