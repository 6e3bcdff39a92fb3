"""Scatter-add (BEV pooling) and gathers on codes in a forward torch.fx cannot trace (a loop over
the cameras, ``range(f.shape[0])``), captured by call site (dal.prepare.call_sites) and quantized
as the traced ones are (export/SPEC.md §5c, §5d): int32-exact sums of the codes then requantized,
gathers passing the input's scale through; exported in §5c / §5d's form; the a1000 refuses them
by path and source line; bad indices are errors naming the site.

Oracles: torch's own scatter_add / index_put / index_add / gather in float64 on the codes of the
module's quantizers (ONNX QuantizeLinear's float32 division, ties to even), dal.verify's verdict
(dal.npu from the file == dal.convert on every element, onnxruntime with optimizations off layer
by layer), the hardware YAML for what the a1000 lacks."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import dal
from dal.nn.gather import QGather
from dal.nn.scatter_add import QScatterAdd
from dal.recipe.errors import RecipeError

torch.set_num_threads(1)
CAMS, K, M, C = 3, 20, 12, 5
A = {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}
RECIPE = {"name": "bev_int8", "rules": [{"type": ["scatter_add", "gather"], "input": A}]}
SCATTERS = ("index_put", "scatter_add", "index_add")
GATHERS = ("gather", "index_select", "take_along_dim")


class Splat(nn.Module):
    """Per camera: pool its features into a BEV grid (a scatter-add spelling, in place or not), or
    pick rows of them (a gather spelling); the cameras stacked. ``range(f.shape[0])`` makes fx fail."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, f, idx):
        outs = []
        for c in range(f.shape[0]):
            fc, ic = f[c], idx[c]
            bev = fc.new_zeros(M, C)
            if self.kind == "index_put":
                bev.index_put_((ic,), fc, accumulate=True)  # in place: bev is what the call wrote
            elif self.kind == "scatter_add":
                bev = torch.scatter_add(bev, 0, ic[:, None].expand(K, C), fc)
            elif self.kind == "index_add":
                bev.index_add_(0, ic, fc)
            elif self.kind == "gather":
                bev = torch.gather(fc, 0, ic[:M, None].expand(M, C))
            elif self.kind == "index_select":
                bev = fc.index_select(0, ic[:M])
            else:
                bev = torch.take_along_dim(fc, ic[:M, None].expand(M, C), dim=0)
            outs.append(bev)
        return torch.stack(outs)


def _data(seed: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(CAMS, K, C, generator=g) + 0.6  # asymmetric: a uint8 zero point far from 0
    hi = K if kind in GATHERS else M
    idx = torch.randint(-hi if kind == "index_put" else 0, hi, (CAMS, K), generator=g)
    return f, idx


def _codes(x: torch.Tensor, q) -> tuple[torch.Tensor, float, int]:
    """``(codes - zp, s, zp)`` of ``x`` under quantizer ``q`` as ONNX QuantizeLinear makes them."""
    s, z = q.effective_qparams()
    s, z = float(s), int(z)
    c = torch.clamp(torch.round(x / torch.tensor(s, dtype=torch.float32)) + z, 0, 255)
    return (c - z).double(), s, z


def _oracle(kind: str, f, idx, mods) -> torch.Tensor:
    """The module doc's oracle, camera by camera, with each site's own quantizers."""
    outs = []
    for c, m in enumerate(mods):
        u, s, _ = _codes(f[c], m.input_quant)
        acc = torch.zeros(M, C, dtype=torch.float64)
        if kind in SCATTERS:
            i = idx[c]
            acc = acc.index_put((i,), u, accumulate=True) if kind == "index_put" else \
                torch.scatter_add(acc, 0, i[:, None].expand(K, C), u) if kind == "scatter_add" else acc.index_add(0, i, u)
            v = (acc * s).float()
            y, so, _ = _codes(v, m.output_quant)
            outs.append((y * so).float())
        else:
            picked = torch.gather(u, 0, idx[c][:M, None].expand(M, C))
            outs.append((picked * s).float())  # the input's scale, passed through
    return torch.stack(outs)


@pytest.fixture(scope="module", params=SCATTERS + GATHERS)
def splat(request, tmp_path_factory):
    """(kind, prepared + calibrated model in eval, its site modules in camera order, inputs, ONNX path)."""
    kind = request.param
    f, idx = _data(0, kind)
    p = dal.prepare_qat(Splat(kind), recipe=RECIPE, hardware="a2000", example_inputs=(f, idx))
    dal.calibrate(p, [((f, idx), None), ((_data(1, kind)[0], idx), None)], progress=False)
    p.eval()
    cls = QScatterAdd if kind in SCATTERS else QGather
    mods = [m for k, m in sorted(p.dal_sites.items(), key=lambda kv: kv[0]) if isinstance(m, cls)]
    path = str(tmp_path_factory.mktemp("site_scatter") / f"{kind}.onnx")
    dal.export_onnx(p, (f, idx), path)
    return kind, p, mods, (f, idx), path


def test_each_spelling_is_a_call_site_module(splat):
    kind, p, mods, *_ = splat
    assert len(mods) == CAMS and all(m.kind == kind for m in mods), [m.kind for m in mods]
    assert all(m.input_quant.fmt.name == "uint8" and m.input_quant.state == "quantize" for m in mods)
    row = {r.name: r for r in dal.prepared(p).report.rows}
    key = "scatter_add" if kind in SCATTERS else "gather"
    assert sum(n.startswith(f"dal_sites.{key}_l") and r.status == "quantized" for n, r in row.items()) == CAMS


def test_qat_equals_the_integer_oracle_on_every_element(splat):
    """The QAT model (an in-place index_put_ / index_add_ included: the call's tensor holds the
    module's result) equals torch's float64 ops on the codes, element for element."""
    kind, p, mods, (f, idx), _ = splat
    with torch.no_grad():
        got = p(f, idx)
    assert torch.equal(got, _oracle(kind, f, idx, mods))
    assert got.abs().sum() > 0


def test_export_form_and_dal_verify(splat):
    """§5c: DQ -> ScatterElements(reduction add) -> Q; §5d: Q -> DQ -> Gather | GatherElements -> Q
    on the input's own scale. dal.verify: integer model == dal.npu on every element, onnxruntime
    within 1 LSB layer by layer (near-ties only)."""
    import onnx
    kind, p, _, args, path = splat
    proto = onnx.load(path)
    ops = [n.op_type for n in proto.graph.node]
    if kind in SCATTERS:
        scat = [n for n in proto.graph.node if n.op_type == "ScatterElements"]
        assert len(scat) == CAMS and all(a.s == b"add" for n in scat for a in n.attribute if a.name == "reduction")
    else:
        want = "Gather" if kind == "index_select" else "GatherElements"
        made_by = {o: n for n in proto.graph.node for o in n.output}
        picks = [n for n in proto.graph.node if n.op_type == want and made_by.get(n.input[0]) is not None
                 and made_by[n.input[0]].op_type == "DequantizeLinear"]
        assert len(picks) == CAMS, ops
        users = {i: n for n in proto.graph.node for i in n.input}
        for n in picks:  # the same scale and zero point before and after: codes in, codes out
            dq, q = made_by[n.input[0]], users[n.output[0]]
            assert q.op_type == "QuantizeLinear" and q.input[1:] == dq.input[1:]
    rep = dal.verify(path, p, args)
    assert rep.integer is not None and rep.integer.identical, rep.verdict_line()
    assert rep.verdict(), rep.verdict_line()


def _line(kind: str) -> int:
    """The source line of ``kind``'s call in Splat.forward."""
    src, start = inspect.getsourcelines(Splat.forward)
    word = {"index_put": "index_put_", "index_add": "index_add_", "scatter_add": "torch.scatter_add"}[kind]
    return start + next(i for i, s in enumerate(src) if word in s)


@pytest.mark.parametrize("kind", ["index_put", "index_add"])
def test_a1000_refuses_by_path_and_source_line(kind):
    f, idx = _data(0, kind)
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(Splat(kind), recipe=RECIPE, hardware="a1000", example_inputs=(f, idx))
    text = str(err.value)
    line = _line(kind)
    for c in range(CAMS):
        assert f"dal_sites.scatter_add_l{line}_{c} (scatter_add, called at test_site_scatter_gather.py:{line})" \
               in text, text
    assert text.count("does not run scatter_add") == CAMS


@pytest.mark.parametrize("kind", ["index_put", "gather"])
def test_bad_indices_at_calibration_are_named_errors(kind):
    """A float index and an index out of range while calibrating: ValueErrors naming the site."""
    f, idx = _data(0, kind)
    p = dal.prepare_qat(Splat(kind), recipe=RECIPE, hardware="a2000", example_inputs=(f, idx))
    site = f"dal_sites.{'scatter_add' if kind in SCATTERS else 'gather'}_l"
    with pytest.raises(ValueError, match=rf"{site}\d+_0: .*must be an integer tensor.*float32"):
        dal.calibrate(p, [((f, idx.float()), None)], progress=False)
    with pytest.raises(ValueError, match=rf"{site}\d+_0: .*out of range"):
        dal.calibrate(p, [((f, idx + 2 * K), None)], progress=False)


def test_no_rule_leaves_them_float_host_ops():
    """Without a recipe rule for gather (int8_balanced has none) the call stays torch's own, listed
    as a host op (the a2000 lists gather for codes only): no module, the float result unchanged."""
    f, idx = _data(0, "index_select")
    p = dal.prepare_qat(Splat("index_select"), recipe="int8_balanced", hardware="a2000", example_inputs=(f, idx))
    rows = [r for r in dal.prepared(p).report.rows if r.name.startswith("dal_sites.gather_l")]
    assert len(rows) == CAMS and all(r.status == "host" for r in rows), rows
    assert not any(isinstance(m, QGather) for m in p.modules())
    assert torch.equal(p(f, idx), Splat("index_select")(f, idx))


def test_a_call_the_module_does_not_compute_stays_torchs():
    """An occupancy count ``index_put_((i,), ones(()), accumulate=True)`` (values broadcast to the
    index, which QScatterAdd does not take) stays torch's own call, listed as a host op, next to a
    pooled feature scatter that is quantized."""

    class Count(nn.Module):
        def forward(self, f, idx):
            n = int(f.shape[0])  # int() of a Proxy: fx cannot trace this forward
            occ = f.new_zeros(M)
            occ.index_put_((idx[:n, 0],), torch.ones(()), accumulate=True)
            bev = f.new_zeros(M, C).index_add(0, idx[:n, 0], f[:, 0])
            return bev * occ[:, None]

    f, idx = _data(0, "index_add")
    p = dal.prepare_qat(Count(), recipe=RECIPE, hardware="a2000", example_inputs=(f, idx))
    rows = {r.name.split("_l")[0] + "/" + r.type_name: r.status for r in dal.prepared(p).report.rows
            if r.name.startswith("dal_sites.scatter_add_l")}
    assert rows == {"dal_sites.scatter_add/index_put": "host", "dal_sites.scatter_add/QScatterAdd": "quantized"}, rows
    occ = [m for m in p.modules() if isinstance(m, QScatterAdd)]
    assert len(occ) == 1 and occ[0].kind == "index_add"
    with torch.no_grad():
        assert torch.equal(p(f, idx), Count()(f, idx))  # quantizers still observing: float numbers
