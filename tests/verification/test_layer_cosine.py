"""dal.verify's per-layer cosine against the float model (issue 43 item 4): ``LayerParity.float_cosine``.

Oracle: the NPU reference's codes at each activation QuantizeLinear, dequantized with the file's own
scale and zero point (read here with onnx.numpy_helper), against the value the torch model with
every quantizer off computes at the same quantizer (a forward hook written here), cosine in float64
as ``np.dot(a, b) / (norm(a) * norm(b))``. Checked on dal_examples.zoo.MnistCNN and on a tiny HF Llama
(w4a8_int8_llm, dal.export_onnx, an additive causal mask input: no int64 mask arithmetic). A point
where quantization is the identity (inputs on the input quantizer's grid) has cosine 1; a corrupted
conv weight scale in the file lowers the cosine of the layer it feeds; the figure is rendered beside
the LSB counts and is in ``to_dict()`` (strict JSON).
"""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from onnx import numpy_helper  # noqa: E402

import dal  # noqa: E402
import dal.npu  # noqa: E402
from dal.prepare import set_quantizer_state  # noqa: E402
from dal_examples.zoo import MnistCNN  # noqa: E402

SHAPE = (2, 1, 28, 28)


def _oracle(path, model, inputs) -> dict:
    """``{QuantizeLinear node name: float64 cosine}``: NPU dequantized vs float model, computed here."""
    proto = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    feed = {i.name: x.numpy() for i, x in zip(proto.graph.input, inputs)}
    _, values = dal.npu.load(proto).run(feed, return_intermediates=True)
    modules = dict(model.named_modules())
    floats, hooks = {}, []

    def keep(node, out):
        floats.setdefault(node.name, (node, out.detach().double().numpy()))  # the first call; output unchanged

    for node in proto.graph.node:
        base = node.name[: -len("/QuantizeLinear")] if node.name.endswith("/QuantizeLinear") else None
        if node.op_type == "QuantizeLinear" and base in modules:
            hooks.append(modules[base].register_forward_hook(lambda m, a, out, node=node: keep(node, out)))
    try:
        with dal.quantizer_states(model, "off"), torch.no_grad():
            model.eval()(*inputs)
    finally:
        for h in hooks:
            h.remove()
    found = {}
    for name, (node, ref) in floats.items():
        s, zp = inits.get(node.input[1]), inits.get(node.input[2])
        if s is None or zp is None or s.size != 1:
            continue
        deq = (values[node.output[0]].astype(np.float64) - float(zp.reshape(()))) * float(s.reshape(()))
        a, b = deq.reshape(-1), ref.reshape(-1)
        found[name] = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
    return found


def _check_rows(rep, oracle):
    rows = {r.node: r for r in rep.torch_layers}
    assert rows and set(rows) == set(oracle), (sorted(rows), sorted(oracle))
    for node, want in oracle.items():
        assert rows[node].float_cosine is not None, node
        assert abs(rows[node].float_cosine - want) <= 1e-12, (node, rows[node].float_cosine, want)


def _rendered_and_dict(rep):
    text = str(rep)
    data = json.loads(json.dumps(rep.to_dict(), allow_nan=False))
    assert data["verdict"] == rep.verdict()
    for row, d in zip(rep.torch_layers, data["torch_layers"]):
        assert d["float_cosine"] == row.float_cosine and d["differ"] == row.differ and d["node"] == row.node
        # beside the LSB counts, on the row's own line
        (line,) = [ln for ln in text.splitlines()  # the table row, not a listing of differing rows
                   if ln.startswith(f"  {row.tensor} ") and not ln.startswith(f"  {row.tensor} (")]
        assert line.split()[-4:] == [f"{row.differ}/{row.elements}", f"{row.max_abs:.3g}", f"{row.cosine:.6f}",
                                     f"{row.float_cosine:.6f}"], line


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    torch.manual_seed(0)
    q = dal.prepare_qat(MnistCNN(), recipe="int8_balanced", hardware="a2000", example_inputs=(torch.randn(SHAPE),))
    dal.calibrate(q, [torch.randn(SHAPE) for _ in range(2)], progress=False)
    set_quantizer_state(q, "frozen")
    q.eval()
    tmp = tmp_path_factory.mktemp("layer_cosine")
    good = tmp / "good.onnx"
    dal.export_onnx(q, (torch.randn(SHAPE),), good)
    proto = onnx.load(str(good))
    init = next(t for t in proto.graph.initializer if t.name == "conv.weight_quant.scale")
    s = numpy_helper.to_array(init).copy()
    s.reshape(s.shape[0], -1)[::2] *= np.float32(4)  # every other output channel 4x: not a common factor
    init.CopyFrom(numpy_helper.from_array(s, init.name))
    bad = tmp / "bad.onnx"
    onnx.save(proto, str(bad))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    return q, good, bad, (x,)


def test_cnn_cosine_per_layer_equals_float64_oracle(cnn):
    q, good, _, inputs = cnn
    rep = dal.verify(good, q, inputs, onnxruntime=False)
    _check_rows(rep, _oracle(good, q, inputs))
    assert all(r.float_cosine < 1 for r in rep.torch_layers)  # quantization error is there, and seen
    _rendered_and_dict(rep)


def test_cnn_identity_point_is_one_and_corrupt_scale_drops(cnn):
    q, good, bad, _ = cnn
    proto = onnx.load(str(good))
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    x_name = proto.graph.input[0].name
    first = next(n for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == x_name)
    s, zp = np.float32(inits[first.input[1]]), inits[first.input[2]]
    info = np.iinfo(zp.dtype)
    codes = np.random.default_rng(3).integers(info.min, info.max + 1, SHAPE)
    # on the input quantizer's grid, in range: it changes nothing, the NPU's value is the float model's
    on_grid = (torch.from_numpy(((codes - int(zp)) * s).astype(np.float32)),)
    rep = dal.verify(good, q, on_grid, onnxruntime=False)
    row = next(r for r in rep.torch_layers if r.node == first.name)
    assert abs(row.float_cosine - 1.0) <= 1e-15, row.float_cosine
    assert _oracle(good, q, on_grid)[first.name] == pytest.approx(1.0, abs=1e-15)

    ok = {r.node: r.float_cosine for r in dal.verify(good, q, cnn[3], onnxruntime=False).torch_layers}
    rep_bad = dal.verify(bad, q, cnn[3], onnxruntime=False)
    _check_rows(rep_bad, _oracle(bad, q, cnn[3]))
    worse = {r.node: r.float_cosine for r in rep_bad.torch_layers}
    fed = "add.input_quants.1/QuantizeLinear"  # the quantizer reading conv's output
    assert worse[fed] < ok[fed] - 0.05, (worse[fed], ok[fed])
    before = [n for n in ok if rep_bad.order[n] < rep_bad.order[fed]]
    assert before and all(worse[n] == ok[n] for n in before)  # upstream of the corrupted conv: unchanged


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    T = pytest.importorskip("transformers")
    from dal.export.decoder import causal_mask

    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                         max_position_embeddings=128))
    p = dal.prepare_qat(m, recipe="w4a8_int8_llm", hardware="a2000")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    dal.calibrate(p, [ids], progress=False)
    p.eval()
    inputs = (ids[:1], causal_mask(torch.ones(1, 16, dtype=torch.bool), 16, False))
    path = tmp_path_factory.mktemp("layer_cosine_llama") / "llama.onnx"
    dal.export_onnx(p, inputs, path)
    return p, path, inputs


def test_llama_cosine_per_layer_equals_float64_oracle(llama):
    p, path, inputs = llama
    rep = dal.verify(path, p, inputs, onnxruntime=False)
    oracle = _oracle(path, p, inputs)
    assert len(oracle) >= 27  # every activation quantizer of both decoder layers and lm_head
    _check_rows(rep, oracle)
    assert all(0.9 < r.float_cosine < 1 for r in rep.torch_layers)
    _rendered_and_dict(rep)
