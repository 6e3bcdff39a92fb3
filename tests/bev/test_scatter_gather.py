"""BEV pooling as scatter-add and gathers on codes, trained, exported and run bit-exact
(export/SPEC.md §5c, §5d).

Oracles: torch's own float ops (the QAT bound), a numpy int64 / float64 model of §5c's arithmetic
written here from the quantizers' scales (the QAT model and both integer engines must equal it on
every element), onnxruntime with optimizations off (the scatter's inputs are graph inputs, so the
comparison is layer by layer: within 1 LSB, differing codes only at near-ties of its float32 sums),
and dal.npu (from the file) against dal.convert (from the torch model), element by element."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import dal
import dal.npu
from dal.nn.gather import QGather
from dal.nn.scatter_add import QScatterAdd
from dal.nn.spec import layer_spec, tensor_spec
from dal.recipe.errors import RecipeError
from oracles import ort_session, run_ort

torch.set_num_threads(1)
K, M, C = 96, 12, 5          # updates, destination rows, channels
A = {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}
RECIPE = {"name": "bev_int8", "rules": [{"type": ["scatter_add", "gather"], "input": A}]}
SPEC = layer_spec(input=tensor_spec("uint8", symmetric=False))


class Pool(nn.Module):
    """BEV pooling three ways: index_put_ in place (negative indices too), torch.scatter_add with
    a per-column index, index_add out of place."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, f, idx):
        bev = f.new_zeros(M, C)
        if self.kind == "index_put":
            bev.index_put_((idx,), f, accumulate=True)
            return bev
        if self.kind == "scatter_add":
            return torch.scatter_add(bev, 0, idx, f)
        return bev.index_add(0, idx, f)


def _data(kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(K, C, generator=g) + 0.7  # an asymmetric range: a uint8 zero point far from 0
    if kind == "index_put":
        return f, torch.randint(-M, M, (K,), generator=g)
    if kind == "scatter_add":
        return f, torch.randint(0, M, (K, C), generator=g)
    return f, torch.randint(0, M, (K,), generator=g)


def _float(kind, f, idx):
    return Pool(kind)(f, idx)


def _counts(kind, idx) -> np.ndarray:
    """Contributions per destination element (M, C)."""
    if kind == "scatter_add":
        return torch.scatter_add(torch.zeros(M, C), 0, idx, torch.ones(K, C)).numpy()
    rows = torch.bincount(idx % M, minlength=M).float()
    return rows[:, None].expand(M, C).numpy()


def _oracle(kind, f, idx, s, z, so, zo) -> np.ndarray:
    """§5c in numpy: codes by ONNX QuantizeLinear (float32 division), int64 sum of code - z,
    float32(float64(acc) * s), then the output QuantizeLinear; returned dequantized (float32)."""
    s, so = np.float32(s), np.float32(so)
    u = np.clip(np.rint(f.numpy() / s) + z, 0, 255).astype(np.int64) - z
    acc = np.zeros((M, C), np.int64)
    i = idx.numpy() % M
    if kind == "scatter_add":
        np.add.at(acc, (i, np.broadcast_to(np.arange(C), i.shape)), u)
    else:
        np.add.at(acc, i, u)
    v = (acc.astype(np.float64) * np.float64(s)).astype(np.float32)
    y = np.clip(np.rint(v / so) + zo, 0, 255)
    return ((y - zo) * so).astype(np.float32), acc


def _qparams(q):
    s, z = q.effective_qparams()
    return float(s), int(z)


@pytest.fixture(scope="module", params=["index_put", "scatter_add", "index_add"])
def pooled(request, tmp_path_factory):
    """(kind, prepared + calibrated model, ONNX path, dal.npu session, integer model)."""
    kind = request.param
    torch.manual_seed(0)
    f, idx = _data(kind, 0)
    p = dal.prepare_qat(Pool(kind), recipe=RECIPE, hardware="a2000", example_inputs=(f, idx))
    dal.calibrate(p, [((f, idx), None)] + [((_data(kind, s)[0], idx), None) for s in (1, 2)], progress=False)
    path = str(tmp_path_factory.mktemp("scatter") / f"{kind}.onnx")
    dal.export_onnx(p, (f, idx), path)
    return kind, p, path, dal.npu.load(path), dal.convert(p)


def _module(p) -> QScatterAdd:
    return next(m for m in p.modules() if isinstance(m, QScatterAdd))


def test_prepare_captures_each_spelling(pooled):
    kind, p, *_ = pooled
    m = _module(p)
    assert m.kind == kind and m.input_quant is not None and m.output_quant is not None
    assert m.input_quant.fmt.name == "uint8" and m.output_quant.state == "quantize"


def test_qat_equals_the_integer_oracle_and_stays_within_the_quantization_bound(pooled):
    kind, p, *_ = pooled
    m = _module(p)
    (s, z), (so, zo) = _qparams(m.input_quant), _qparams(m.output_quant)
    assert z not in (0, 255)  # the zero point is exercised
    for seed in (0, 3):
        f, idx = _data(kind, seed)
        with torch.no_grad():
            y = p(f, idx)
        want, _ = _oracle(kind, f, idx, s, z, so, zo)
        assert np.array_equal(y.numpy(), want), f"{kind}: QAT model != integer oracle"
        # against torch's float op: n half-LSBs of the input per element plus half an output LSB
        err = (y - _float(kind, f, idx)).abs().numpy()
        bound = _counts(kind, idx) * s / 2 + so / 2
        codes = np.rint(want / np.float32(so)) + zo
        clipped = (codes == 0) | (codes == 255)  # at the end of the calibrated range (seed 3): maybe clipped
        assert np.all((err <= bound * (1 + 1e-5)) | clipped), f"{kind}: {(err / so).max():.3f} LSB"


def test_export_form_and_the_integer_group(pooled):
    kind, p, path, sess, _ = pooled
    import onnx
    model = onnx.load(path)
    nodes = {n.output[0]: n for n in model.graph.node}
    sc = [n for n in model.graph.node if n.op_type == "ScatterElements"]
    assert len(sc) == 1 and next(a.s for a in sc[0].attribute if a.name == "reduction") == b"add"
    assert [nodes[sc[0].input[i]].op_type for i in (0, 2)] == ["DequantizeLinear"] * 2
    dq_d, dq_u = nodes[sc[0].input[0]], nodes[sc[0].input[2]]
    assert dq_d.input[1:] == dq_u.input[1:] or all(  # the same scale and zero point (maybe folded copies)
        np.array_equal(onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == a)),
                       onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == b)))
        for a, b in zip(dq_d.input[1:], dq_u.input[1:]))
    assert [n.op_type for n in model.graph.node if sc[0].output[0] in n.input] == ["QuantizeLinear"]
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 16
    assert any(type(st).__name__ == "ScatterAddCodes" for st in sess.steps)


def test_npu_equals_convert_and_the_oracle_on_every_element(pooled):
    kind, p, path, sess, im = pooled
    m = _module(p)
    (s, z), (so, zo) = _qparams(m.input_quant), _qparams(m.output_quant)
    for seed in (0, 4):
        f, idx = _data(kind, seed)
        got = sess.run({"input_0": f.numpy(), "input_1": idx.numpy()})[0]
        assert np.array_equal(got, im(f, idx).numpy()), f"{kind}: dal.npu != dal.convert"
        assert np.array_equal(got, _oracle(kind, f, idx, s, z, so, zo)[0])


def test_onnxruntime_within_one_lsb_at_near_ties_only(pooled):
    kind, p, path, sess, _ = pooled
    m = _module(p)
    (s, z), (so, zo) = _qparams(m.input_quant), _qparams(m.output_quant)
    ort = ort_session(path)
    for seed in range(6):
        f, idx = _data(kind, seed)
        feeds = {"input_0": f.numpy(), "input_1": idx.numpy()}
        got = sess.run(feeds)[0]
        want = ort.run(None, feeds)[0]
        d = np.rint(np.abs(got.astype(np.float64) - want) / so)
        assert d.max() <= 1, f"{kind}: {int(d.max())} LSB from onnxruntime"
        _, acc = _oracle(kind, f, idx, s, z, so, zo)
        v = acc * np.float64(np.float32(s)) / np.float64(np.float32(so))  # exact value in output LSBs
        # onnxruntime sums float32 products (q - z) * s: at most (n + 2) roundings of 2^-24 of the
        # sum of |terms| (here bounded by n * 255 * s), then a float32 division
        slack = ((_counts(kind, idx) + 2) * 2.0 ** -23 * (_counts(kind, idx) + 1) * 255 * s / so
                 + 2.0 ** -22 * np.abs(v))
        tie = np.abs(np.abs(v - np.floor(v)) - 0.5) <= slack
        assert np.all(tie[d > 0]), f"{kind}: a differing code is no near-tie"


def test_float32_bound_crossed_sums_in_float64():
    """70,000 updates into one row: |acc| exceeds 2^24, where float32 would round; the QAT model
    switches to float64 and still equals the integer oracle."""
    m = QScatterAdd(SPEC, "bev.pool", kind="index_put")
    f = torch.full((70000, C), 3.0)
    f[::1000] = 0.0
    idx = torch.zeros(70000, dtype=torch.long)
    x = torch.zeros(1, C)
    dal.calibrate(m, [((x, idx, f), None)], progress=False)
    assert m.accumulator_bound(70000) > 2 ** 24
    s, z = _qparams(m.input_quant)
    so, zo = _qparams(m.output_quant)
    with torch.no_grad():
        y = m(x, idx, f).numpy()
    u = np.clip(np.rint(f.numpy() / np.float32(s)) + z, 0, 255).astype(np.int64) - z
    acc = u.sum(0, keepdims=True)
    assert np.abs(acc).max() > 2 ** 24
    v = (acc.astype(np.float64) * np.float64(np.float32(s))).astype(np.float32)
    want = ((np.clip(np.rint(v / np.float32(so)) + zo, 0, 255) - zo) * np.float32(so)).astype(np.float32)
    assert np.array_equal(y, want)


def test_int32_accumulator_limit_refused_naming_the_layer():
    m = QScatterAdd(SPEC, "bev.pool", kind="index_put")
    m.input_quant.set_qparams(torch.tensor(0.1), torch.tensor(128, dtype=torch.int32))
    m.output_quant.set_qparams(torch.tensor(0.1), torch.tensor(128, dtype=torch.int32))
    for q in (m.input_quant, m.output_quant):
        q.set_state("frozen")
    n = 2 ** 31 // 255
    with pytest.raises(ValueError, match=r"bev\.pool: up to 8421504 contributions.*int32"):
        m.eval()(torch.zeros(2, 1), torch.zeros(n, dtype=torch.long), torch.zeros(1, 1).expand(n, 1))


@pytest.mark.parametrize("kind", ["index_put", "scatter_add", "index_add"])
def test_bad_indices_are_named_errors(kind):
    f, idx = _data(kind, 0)
    m = QScatterAdd(SPEC, "bev.pool", kind=kind)
    with pytest.raises(ValueError, match=r"bev\.pool: .*index must be an integer tensor.*float"):
        m(torch.zeros(M, C), idx.float(), f)
    bad = idx.clone()
    bad[3] = M if kind != "index_put" else -M - 1
    with pytest.raises(ValueError, match=rf"bev\.pool: {kind} index out of range"):
        dal.calibrate(m, [((torch.zeros(M, C), bad, f), None)], progress=False)
    with pytest.raises(ValueError, match=r"bev\.pool: .*(shape|rank|needs)"):
        m(torch.zeros(M, C), idx, f[:-1] if kind != "scatter_add" else f[:, :1].expand(K, 1).reshape(K))


class PoolHead(Pool):
    def __init__(self, kind: str):
        super().__init__(kind)
        self.fc = nn.Linear(C, C)

    def forward(self, f, idx):
        return self.fc(super().forward(f, idx))


def test_a1000_refuses_by_path_and_a_skip_rule_keeps_it_float():
    f, idx = _data("index_add", 0)
    with pytest.raises(RecipeError, match=r"index_add.*\(scatter_add\): hardware 'a1000' does not run scatter_add"):
        dal.prepare_qat(Pool("index_add"), recipe=RECIPE, hardware="a1000", example_inputs=(f, idx))
    linear = {"type": "linear", "weight": {"format": "int8", "symmetric": True}, "input": A}
    skip = {"name": "bev_skip", "rules": [{"type": "scatter_add", "skip": True}, linear, *RECIPE["rules"]]}
    torch.manual_seed(0)
    net = PoolHead("index_add")
    p = dal.prepare_qat(net, recipe=skip, hardware="a1000", example_inputs=(f, idx))
    assert not any(isinstance(m, QScatterAdd) for m in p.modules())
    dal.calibrate(p, [((f, idx), None)], progress=False)
    assert p(f, idx).shape == (M, C)
    x, i = torch.randn(2, 6, 4), torch.randint(0, 6, (2, 3, 4))
    with pytest.raises(RecipeError, match=r"gather \(gather\): hardware 'a1000' does not run gather"):
        dal.prepare_qat(Pick("gather"), recipe=RECIPE, hardware="a1000", example_inputs=(x, i))


# ------------------------------------------------------------------ gathers on codes
class Pick(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x, idx):
        if self.kind == "gather":
            return torch.gather(x, 1, idx)
        if self.kind == "index_select":
            return x.index_select(1, idx[0, 0])
        return torch.take_along_dim(x, idx[:, :1, :], dim=2)


@pytest.mark.parametrize("kind", ["gather", "index_select", "take_along_dim"])
def test_gather_on_codes_scale_passed_through(kind, tmp_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 4, generator=g) * 2 + 0.5
    idx = torch.randint(0, 6 if kind != "take_along_dim" else 4, (2, 3, 4), generator=g)
    p = dal.prepare_qat(Pick(kind), recipe=RECIPE, hardware="a2000", example_inputs=(x, idx))
    m = next(mod for mod in p.modules() if isinstance(mod, QGather))
    assert m.kind == kind
    dal.calibrate(p, [((x, idx), None)], progress=False)
    s, z = _qparams(m.input_quant)
    with torch.no_grad():
        y = p(x, idx)
    xq = ((np.clip(np.rint(x.numpy() / np.float32(s)) + z, 0, 255) - z) * np.float32(s)).astype(np.float32)
    assert np.array_equal(y.numpy(), Pick(kind)(torch.from_numpy(xq), idx).numpy())  # torch's op on Q(x)
    path = str(tmp_path / f"{kind}.onnx")
    model = dal.export_onnx(p, (x, idx), path)
    readers = {i for n in model.graph.node if n.op_type == "QuantizeLinear" for i in n.input[:1]}
    op = next(n for n in model.graph.node if n.op_type in ("Gather", "GatherElements") and n.output[0] in readers)
    after = [n for n in model.graph.node if op.output[0] in n.input]
    before = next(n for n in model.graph.node if n.output[0] == op.input[0])
    assert before.op_type == "DequantizeLinear" and [n.op_type for n in after] == ["QuantizeLinear"]
    assert after[0].input[1:] == before.input[1:]  # the input's own scale and zero point: no requantization
    feeds = {"input_0": x.numpy(), "input_1": idx.numpy()}
    got = dal.npu.load(path).run(feeds)[0]
    assert np.array_equal(got, run_ort(path, feeds)[0]) and np.array_equal(got, y.numpy())
    assert np.array_equal(got, dal.convert(p)(x, idx).numpy())


def test_gather_bad_indices_are_named_errors():
    m = QGather(SPEC, "head.pick", kind="gather", dim=1)
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"head\.pick: gather index must be an integer tensor"):
        m(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"head\.pick: gather index out of range"):
        dal.calibrate(m, [((x, torch.full((2, 3), 6)), None)], progress=False)
    emb = dal.prepare_qat(nn.Sequential(nn.Embedding(10, 4)), recipe="int8_balanced", hardware="a2000")
    with pytest.raises(ValueError, match=r"0: indices must be an integer tensor"):
        emb(torch.zeros(3))


def test_embedding_gathers_the_weight_codes(tmp_path):
    """nn.Embedding (QEmbedding): the file gathers DQ(int8 table); dal.npu == onnxruntime ==
    dal.convert == torch on every element (a copy of dequantized codes)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4))
    ids = torch.randint(0, 10, (2, 5))
    p = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000")
    dal.calibrate(p, [ids], progress=False)
    path = str(tmp_path / "emb.onnx")
    model = dal.export_onnx(p, (ids,), path)
    gather = next(n for n in model.graph.node if n.op_type == "Gather")
    assert next(n for n in model.graph.node if n.output[0] == gather.input[0]).op_type == "DequantizeLinear"
    got = dal.npu.load(path).run({"input": ids.numpy()})[0]
    with torch.no_grad():
        y = p(ids).numpy()
    assert np.array_equal(got, run_ort(path, {"input": ids.numpy()})[0]) and np.array_equal(got, y)
    assert np.array_equal(got, dal.convert(p)(ids).numpy())


def test_qat_step_then_dal_verify_passes(tmp_path):
    """index_put_ pooling under a quantized Linear: a training step sends finite, nonzero gradients
    through the integer sum (straight-through), and dal.verify's verdict passes on the export."""
    f, idx = _data("index_put", 0)
    linear = {"type": "linear", "weight": {"format": "int8", "symmetric": True}, "input": A}
    torch.manual_seed(0)
    p = dal.prepare_qat(PoolHead("index_put"), recipe={"name": "r", "rules": [linear, *RECIPE["rules"]]},
                        hardware="a2000", example_inputs=(f, idx))
    dal.calibrate(p, [((f, idx), None)], progress=False)
    p.train()
    fr = f.clone().requires_grad_(True)
    p(fr, idx).square().mean().backward()
    assert torch.isfinite(fr.grad).all() and fr.grad.abs().sum() > 0 and p.fc.weight.grad.abs().sum() > 0
    p.eval()
    path = str(tmp_path / "pool.onnx")
    dal.export_onnx(p, (f, idx), path)
    report = dal.verify(path, p, (f, idx))
    assert "VERDICT: PASS" in str(report) and "integer model vs NPU: IDENTICAL" in str(report), str(report)


def _scatter_nd_model(codes_type, with_dq: bool):
    """data (4, 3), indices (6, 1) with duplicates, updates (6, 3) -> ScatterND(add); with_dq:
    both through DQ(0.05, 3) and the sum through Q(0.11, 7) (the §5c integer group), else on the
    raw codes."""
    from onnx import TensorProto, helper, numpy_helper
    et = TensorProto.INT8 if codes_type == np.int8 else TensorProto.UINT8
    inits = [numpy_helper.from_array(np.array([[0], [2], [0], [3], [0], [2]], np.int64), "idx")]
    nodes = []
    d, u = "d", "u"
    if with_dq:
        inits += [numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(codes_type(3), "z"),
                  numpy_helper.from_array(np.float32(0.11), "s_y"), numpy_helper.from_array(codes_type(7), "z_y")]
        nodes += [helper.make_node("DequantizeLinear", ["d", "s", "z"], ["d_f"], name="d_dq"),
                  helper.make_node("DequantizeLinear", ["u", "s", "z"], ["u_f"], name="u_dq")]
        d, u = "d_f", "u_f"
    nodes.append(helper.make_node("ScatterND", [d, "idx", u], ["acc"], name="pool", reduction="add"))
    out = "acc"
    if with_dq:
        nodes.append(helper.make_node("QuantizeLinear", ["acc", "s_y", "z_y"], ["y"], name="y_q"))
        out = "y"
    graph = helper.make_graph(nodes, "nd", [helper.make_tensor_value_info("d", et, [4, 3]),
                                            helper.make_tensor_value_info("u", et, [6, 3])],
                              [helper.make_tensor_value_info(out, et, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_scatter_nd_add_group_and_the_wide_accumulator():
    """A foreign file's DQ -> ScatterND(add) -> Q is the same integer group (equal to the numpy
    oracle, within 1 LSB of onnxruntime); ScatterND(add) on raw int8 codes, which onnxruntime wraps
    (100 + 100 gives -56), is refused by dal.npu naming the node."""
    rng = np.random.default_rng(0)
    d = rng.integers(-128, 128, (4, 3)).astype(np.int8)
    u = rng.integers(-128, 128, (6, 3)).astype(np.int8)
    m = _scatter_nd_model(np.int8, True)
    sess = dal.npu.load(m)
    assert any(type(st).__name__ == "ScatterAddCodes" for st in sess.steps)
    got = sess.run({"d": d, "u": u})[0]
    acc = d.astype(np.int64) - 3
    np.add.at(acc, np.array([0, 2, 0, 3, 0, 2]), u.astype(np.int64) - 3)
    v = (acc * np.float64(np.float32(0.05))).astype(np.float32)
    assert np.array_equal(got, np.clip(np.rint(v / np.float32(0.11)) + 7, -128, 127).astype(np.int8))
    assert np.abs(got.astype(int) - run_ort(m, {"d": d, "u": u})[0].astype(int)).max() <= 1
    raw = _scatter_nd_model(np.int8, False)
    d, u = np.full((4, 3), 100, np.int8), np.full((6, 3), 100, np.int8)
    assert run_ort(raw, {"d": d, "u": u})[0][3, 0] == -56  # row 3: 100 + 100, wrapped by onnxruntime
    with pytest.raises(dal.npu.NPUError, match=r"'pool'.*leaves int8"):
        dal.npu.load(raw).run({"d": d, "u": u})


def test_checkpoint_restores_the_pool_bit_for_bit(pooled):
    """prepare_qat on a fresh float model, then load_state_dict: the same quantizers (state,
    scales, zero points) and the same outputs, bit for bit."""
    kind, p, *_ = pooled
    f, idx = _data(kind, 5)
    fresh = dal.prepare_qat(Pool(kind), recipe=RECIPE, hardware="a2000", example_inputs=(f, idx))
    fresh.load_state_dict(p.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(f, idx), p(f, idx))


def test_a_float_scatter_add_is_listed_as_a_host_op():
    """No recipe rule quantizes it: index_add stays the float op, listed "host" (the a2000 runs
    scatter-add on integer codes only), and strict=True refuses it naming the call."""
    f, idx = _data("index_add", 0)
    linear = {"type": "linear", "weight": {"format": "int8", "symmetric": True}, "input": A}
    recipe = {"name": "no_scatter", "rules": [linear]}
    p = dal.prepare_qat(PoolHead("index_add"), recipe=recipe, hardware="a2000", example_inputs=(f, idx))
    rows = [r for r in dal.prepared(p).report.rows if r.status == "host"]
    assert [(r.op_class, r.type_name) for r in rows] == [("scatter_add", "index_add")]
    with pytest.raises(ValueError, match=r"index_add \(scatter_add\)"):
        dal.prepare_qat(PoolHead("index_add"), recipe=recipe, hardware="a2000", example_inputs=(f, idx), strict=True)


def test_integer_tensors_pass_unquantized():
    """A captured scatter-add or gather of integer tensors (counts, positions) is torch's own op:
    nothing to quantize."""
    m = QScatterAdd(SPEC, "bev.count", kind="index_add")
    idx = torch.tensor([0, 2, 2, 3])
    assert torch.equal(m(torch.zeros(4, dtype=torch.long), idx, torch.ones(4, dtype=torch.long)),
                       torch.tensor([1, 0, 2, 1]))
    g = QGather(SPEC, "pos", kind="index_select", dim=0)
    assert torch.equal(g(torch.arange(10, 15), torch.tensor([4, 0])), torch.tensor([14, 10]))
