"""The hand-written BEV-style module (bev_block.py: six cameras, grid_sample onto a BEV grid,
Deformable-DETR's pure-PyTorch multi-scale deformable attention with its helper function, the
residual ``norm(query + attn(...))``, a conv head) through prepare, calibrate, a QAT step,
export and dal.verify; the capture defects of issues 41 / 44 each pinned.

Oracles: the float module itself (torch's ops) for the QAT bound; dal.verify's verdict (dal.npu
from the file == dal.convert on every element, onnxruntime with optimizations off within 1 LSB
on near-ties layer by layer); the hardware YAML for what the a1000 refuses."""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

import dal
from dal.nn.grid_sample import QGridSample
from dal.recipe.errors import RecipeError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bev_block import BEVBlock, ms_deform_attn_core_pytorch  # noqa: E402

torch.set_num_threads(1)


def _x(seed=0, batch=2):
    return torch.randn(batch, 6, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def trained():
    """(float model, QAT model after calibration and one SGD step, x): int8_balanced on the a2000."""
    torch.manual_seed(0)
    x = _x()
    model = BEVBlock()
    p = dal.prepare_qat(copy.deepcopy(model), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random-init BN statistics: calibrate says so
        dal.calibrate(p, [x, _x(1)], progress=False, bn_statistics="auto")
    p.train()
    opt = torch.optim.SGD(p.parameters(), lr=0.01)
    p(x).square().mean().backward()
    opt.step()
    return model, p.eval(), x


def _sites(p, owner=""):
    mod = p.get_submodule(owner) if owner else p
    return dict(mod.dal_sites.items())


def test_helper_function_grid_samples_are_call_sites(trained):
    """The three per-level F.grid_sample calls inside ``ms_deform_attn_core_pytorch`` (a helper the
    owner's forward calls, not its own code) are QGridSample call sites of the owner ``attn``,
    keyed with the helper's name; so are the weighted sum's ``*``. The root's six per-camera
    grid_samples stay root sites."""
    _, p, _ = trained
    attn = _sites(p, "attn")
    helper = sorted(k for k, m in attn.items() if isinstance(m, QGridSample))
    assert helper == [f"grid_sample_ms_deform_attn_core_pytorch_l{helper[0].split('_l')[-1].split('_')[0]}_{i}"
                      for i in range(3)], helper
    assert any(k.startswith("mul_ms_deform_attn_core_pytorch_l") for k in attn)
    assert sum(isinstance(m, QGridSample) for m in _sites(p).values()) == 6


def test_submodule_calls_are_not_the_helpers():
    """A call made inside a submodule's forward that the helper calls (the helper gets the module)
    is that module's, not the owner's: only the owner's and its plain helpers' calls are sites."""
    from dal.prepare.call_sites import discover

    class Inner(torch.nn.Module):
        def forward(self, a, b):
            return a + b

    def helper(mod, a, b):
        return mod(a, b) * b

    class Owner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, a, b):
            return helper(self.inner, a, b) + a

    m = Owner()
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    sites = discover(m, [""], lambda: m(a, b))
    kinds = sorted((s.kind, s.key.split("_l")[0]) for s in sites if s.kind)
    assert kinds == [("add", "add"), ("mul", "mul_helper")], kinds


def test_residual_add_after_an_owner_callee_runs_and_calibrates(trained):
    """``y = self.norm(query + self.attn(...))``: the add is a root call site evaluated after
    ``attn`` (itself an owner with its own mode) returns. It runs in every forward after prepare,
    so calibration gives both its quantizers a scale (issue 44: "dal_sites.add_l383_0 ... has no
    scale yet") and the export holds it."""
    _, p, x = trained
    add = _sites(p)
    residual = [k for k in add if k.startswith("add_l") and add[k].input_quants[1].observer.has_data]
    assert residual, "no root add saw data"
    last = max(residual, key=lambda k: int(k.split("_l")[1].split("_")[0]))
    for q in add[last].input_quants:
        assert q.state.quantizes and q.scale.item() > 0
    called = []
    h = add[last].register_forward_pre_hook(lambda m, a: called.append(1))
    try:
        p(x)
    finally:
        h.remove()
    assert called == [1]


def test_a1000_refuses_every_grid_sample_and_float_op_by_path():
    """On the a1000 (no grid_sample, no float engine) every op of the module is quantized and
    listed or refused by path: the nine grid_samples (six per camera, three in the helper), the
    weighted sum's ``.sum``, and the sampling arithmetic (``/ offset_normalizer``, ``2 * loc - 1``)."""
    x = _x()
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(BEVBlock(), recipe="int8_balanced", hardware="a1000", example_inputs=(x,))
    text = str(err.value)
    assert text.count("does not run grid_sample") == 9, text
    assert text.count("attn.dal_sites.grid_sample_ms_deform_attn_core_pytorch_l") == 3 * 2  # path and fix
    for what in ("attn.dal_sites.sum_ms_deform_attn_core_pytorch_l", "attn.dal_sites.float_div_l",
                 "attn.dal_sites.float_sub_ms_deform_attn_core_pytorch_l"):
        assert what in text, (what, text)
    # the sampling add and the weighted sum: op class deformable_attention, which the a1000 lacks
    assert text.count("does not run deformable_attention") == 2, text
    # bev = 0 + grid_sample(...): a neutral int 0, no node in the export, so nothing to refuse
    assert "float_add" not in text, text


def test_bev_block_verifies_on_the_a2000(trained, tmp_path):
    """prepare -> calibrate -> one QAT step -> export -> dal.verify: one verdict, OK (integer
    model == dal.npu on every element; onnxruntime within 1 LSB on near-ties, layer by layer)."""
    _, p, x = trained
    path = tmp_path / "bev.onnx"
    proto = dal.export_onnx(p, (x[:1],), str(path))
    assert sum(n.op_type == "GridSample" for n in proto.graph.node) == 9
    rep = dal.verify(str(path), p, (x[:1],))
    assert rep.verdict() and rep.meets_criterion(), rep.verdict_line()


def test_deformable_roles_are_int16_and_exported_so(trained):
    """int8_balanced on the a2000 (ops.deformable_attention: int16): the sampling add
    (``reference_points + offsets / normalizer``) and the weighted sum's ``*`` are op class
    deformable_attention with int16 symmetric input quantizers; the value and output projections
    stay int8 weights / uint8 inputs; the file quantizes those operands to INT16."""
    from onnx import TensorProto
    _, p, x = trained
    rows = {r.name: r for r in dal.prepared(p).report.rows}
    roles = {n: r for n, r in rows.items() if r.op_class == "deformable_attention"}
    assert sorted(k.split(".")[2].split("_l")[0] for k in roles) == ["add", "mul_ms_deform_attn_core_pytorch"], roles
    for name in roles:
        for q in p.get_submodule(name).input_quants:
            assert q.fmt.name == "int16" and q.zero_point.item() == 0
    assert p.attn.value_proj.weight_quant.fmt.name == "int8" and p.attn.output_proj.input_quant.fmt.name == "uint8"
    proto = dal.export_onnx(p, (x[:1],))
    init = {t.name: t for t in proto.graph.initializer}
    int16_q = [n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[2] in init
               and init[n.input[2]].data_type == TensorProto.INT16]
    assert len(int16_q) >= 4, [n.name for n in int16_q]  # 2 add operands + 2 mul operands (+ grids)


class Core(torch.nn.Module):
    """The MSDA core alone, called as MSDeformAttn calls it: the level shapes a tensor argument
    (so the forward iterates over a Proxy: fx cannot trace it, call sites capture it)."""

    def forward(self, value, shapes, locations, weights):
        return ms_deform_attn_core_pytorch(value, shapes, locations, weights)


def _core_inputs(seed, shapes=((6, 7), (3, 4)), heads=2, dim=4, queries=5, points=3):
    g = torch.Generator().manual_seed(seed)
    s = sum(h * w for h, w in shapes)
    value = torch.randn(1, s, heads, dim, generator=g)
    # 2 * loc - 1 on the int16 grid codes (multiples of 2^-14): the grid quantizer is exact there
    k = torch.randint(-17000, 17000, (1, queries, heads, len(shapes), points, 2), generator=g)
    locations = (k + 16384).float() * 2.0 ** -15
    logits = torch.randn(1, queries, heads, len(shapes) * points, generator=g)
    weights = logits.softmax(-1).view(1, queries, heads, len(shapes), points)
    return value, locations, weights


def test_msda_core_qat_within_the_quantization_bound():
    """QAT vs float (torch's own ops) for the core alone, per output element: with s_v the value
    quantizer's scale (QGridSample: input and output on it, 1/2 LSB each), s_a / s_b the weighted
    sum's int16 operand scales (samples, weights), K = levels x points and the grid on its codes,
    ``|y_qat - y| <= sum_k |w_k| (s_v + s_a/2) + K (max|v| + s_v + s_a/2) s_b/2 + K s_a s_b/4``."""
    shapes = ((6, 7), (3, 4))
    value, loc, w = _core_inputs(0, shapes)
    args = (value, torch.tensor(shapes), loc, w)
    ref = Core()(*args)
    p = dal.prepare_qat(Core(), recipe="int8_balanced", hardware="a2000", example_inputs=args)
    dal.calibrate(p, [args], progress=False, input_fn=lambda b: (b, {}))
    p.eval()
    got = p(*args)
    sites = dict(p.dal_sites.items())
    gs = [m for m in sites.values() if isinstance(m, QGridSample)]
    mul = next(m for k, m in sites.items() if k.startswith("mul_ms_deform"))
    assert len(gs) == 2 and [q.fmt.name for q in mul.input_quants] == ["int16", "int16"]
    s_v = max(m.input_quant.scale.item() for m in gs)
    s_a, s_b = (q.scale.item() for q in mul.input_quants)
    K = w.shape[3] * w.shape[4]
    w_abs = w.abs().sum((3, 4)).max().item()
    bound = w_abs * (s_v + s_a / 2) + K * (value.abs().max().item() + s_v + s_a / 2) * s_b / 2 + K * s_a * s_b / 4
    err = (got - ref).abs().max().item()
    assert 0 < err <= bound * (1 + 1e-5) + 1e-6, (err, bound)
    assert err <= 1.05 * s_v  # int16 weights: the value's own 8-bit rounding dominates


def test_fp16_recipe_keeps_deformable_attention_in_fp16_and_verifies(tmp_path):
    """recipes/int8_deform_fp16 (NVIDIA's scheme): every grid_sample and the weighted sum in FP16,
    the sampling arithmetic float32 (an FP16 add would carry ``2 * loc - 1`` into float16), the
    projections int8; prepare -> calibrate -> QAT step -> export -> dal.verify OK on the a2000,
    and the a1000 refuses it by path."""
    x = _x()
    torch.manual_seed(0)
    p = dal.prepare_qat(BEVBlock(), recipe="int8_deform_fp16", hardware="a2000", example_inputs=(x,))
    rows = {r.name: r for r in dal.prepared(p).report.rows}
    gs = [r for r in rows.values() if r.op_class == "grid_sample"]
    assert len(gs) == 9 and all("fp16" in r.detail for r in gs), [r.detail for r in gs]
    mul = next(r for n, r in rows.items() if n.startswith("attn.dal_sites.mul_ms_deform"))
    add = next(r for n, r in rows.items() if n.startswith("attn.dal_sites.add_l"))
    assert mul.op_class == "deformable_attention" and "fp16" in mul.detail and add.status == "float", (mul, add)
    assert p.attn.value_proj.weight_quant.fmt.name == "int8"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dal.calibrate(p, [x, _x(1)], progress=False, bn_statistics="auto")
    p.train()
    p(x).square().mean().backward()
    p.eval()
    path = tmp_path / "bev16.onnx"
    dal.export_onnx(p, (x[:1],), str(path))
    rep = dal.verify(str(path), p, (x[:1],))
    assert rep.verdict(), rep.verdict_line()
    with pytest.raises(RecipeError, match=r"attn\.dal_sites\.grid_sample_ms_deform_attn_core_pytorch_l\d+_0"):
        dal.prepare_qat(BEVBlock(), recipe="int8_deform_fp16", hardware="a1000", example_inputs=(x,))


class _Sampler(torch.nn.Module):
    """transformers' MultiScaleDeformableAttention form: the core in a child module."""

    def forward(self, value, shapes, locations, weights):
        return ms_deform_attn_core_pytorch(value, shapes, locations, weights)


class _Parent(torch.nn.Module):
    """Computes the sampling locations (``ref + offsets``) and hands them to the child."""

    def __init__(self, levels=2, points=3, heads=2, dim=8):
        super().__init__()
        self.shape = (heads, levels, points)
        self.offsets = torch.nn.Linear(dim, heads * levels * points * 2)
        self.weights = torch.nn.Linear(dim, heads * levels * points)
        self.core = _Sampler()

    def forward(self, value, shapes, ref, query):
        n, q, _ = query.shape
        h, lv, pt = self.shape
        if ref.shape[-1] != 2:  # a branch on a shape: fx cannot trace this forward either
            raise ValueError("2-D reference points only")
        loc = ref[:, :, None, :, None, :] + 0.01 * torch.tanh(self.offsets(query)).view(n, q, h, lv, pt, 2)
        w = self.weights(query).view(n, q, h, lv * pt).softmax(-1).view(n, q, h, lv, pt)
        return self.core(value, shapes, loc, w)


def test_roles_found_across_owners():
    """The sampling add in one owner, the grid_sample and weighted sum in the child it calls (the
    transformers Deformable-DETR layout): both roles are found, each in its own owner."""
    shapes = torch.tensor([(6, 7), (3, 4)])
    g = torch.Generator().manual_seed(3)
    value = torch.randn(1, 54, 2, 4, generator=g)
    ref, query = torch.rand(1, 5, 2, 2, generator=g), torch.randn(1, 5, 8, generator=g)
    p = dal.prepare_qat(_Parent(), recipe="int8_balanced", hardware="a2000", example_inputs=(value, shapes, ref, query))
    roles = sorted((r.name.split("_l")[0], r.type_name) for r in dal.prepared(p).report.rows
                   if r.op_class == "deformable_attention")
    assert roles == [("core.dal_sites.mul_ms_deform_attn_core_pytorch", "QMul"), ("dal_sites.add", "QAdd")], roles
