"""Hugging Face encoders export and verify on the a2000 (issue 43, item 1, last bullet; Check "The HF
encoders export and verify").

BERT (a batch of an unpadded and a padded row, the attention mask as a float additive input), ViT and a Whisper encoder, built
from tiny configs: prepare_qat -> calibrate -> one QAT step with a loss -> export_onnx -> dal.verify,
whose verdict is: the integer model (dal.convert) == dal.npu on every element, and onnxruntime
(ORT_DISABLE_ALL) and the torch model differ from dal.npu layer by layer only on near-ties (1 LSB).
One recipe per encoder keeps the time down (w8a8_llm with NPU attention, w4a8_int8_llm with blocked
INT4 weights, int8_balanced, which leaves attention in float); the other pairings (and w4a8_fp8_llm)
pass the same way when run by hand. DistilBERT is an encoder the issue does not name.

The mask: transformers' own handling of a 2-D padding mask is the oracle for the additive form
(same logits, bit for bit), and the file must carry no int64 compare arithmetic; on dal.npu the
padded positions' token ids change nothing and the mask changes the result. A 2-D mask given to
export is refused naming the argument and what to pass instead.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402
from dal.export import ExportError, additive_attention_mask  # noqa: E402

T = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

SEQ, PAD_FROM = 16, 10


def _bert():
    model = T.BertForSequenceClassification(T.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
        max_position_embeddings=64, num_labels=3))
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, PAD_FROM:] = 0  # row 1 is padded
    bias = additive_attention_mask(mask)
    batches = [(torch.randint(0, 256, (2, SEQ), generator=g), bias) for _ in range(2)]
    labels = torch.tensor([0, 2])
    return model, batches, lambda m, b: m(*b, labels=labels).loss, (batches[0][0], bias), mask


def _distilbert():
    """An encoder the issue does not name, its mask through the float attention of int8_balanced."""
    model = T.DistilBertForSequenceClassification(T.DistilBertConfig(
        dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=256, max_position_embeddings=64, num_labels=3))
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, PAD_FROM:] = 0
    bias = additive_attention_mask(mask)
    batches = [(torch.randint(0, 256, (2, SEQ), generator=g), bias) for _ in range(2)]
    labels = torch.tensor([1, 0])
    return model, batches, lambda m, b: m(*b, labels=labels).loss, (batches[0][0], bias), mask


def _vit():
    model = T.ViTForImageClassification(T.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=3))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 32, 32, generator=g),) for _ in range(2)]
    labels = torch.tensor([1, 2])
    return model, batches, lambda m, b: m(*b, labels=labels).loss, (batches[0][0][:1],), None


def _whisper():
    config = T.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                             max_source_positions=16, vocab_size=256)
    model = T.models.whisper.modeling_whisper.WhisperEncoder(config)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 16, 32, generator=g),) for _ in range(2)]  # 32 frames -> 16 positions
    return model, batches, lambda m, b: m(*b).last_hidden_state.pow(2).mean(), (batches[0][0][:1],), None


CASES = {"bert-w8a8_llm": (_bert, "w8a8_llm"), "vit-w4a8_int8_llm": (_vit, "w4a8_int8_llm"),
         "whisper-int8_balanced": (_whisper, "int8_balanced"), "distilbert-int8_balanced": (_distilbert, "int8_balanced")}


class Deployed:
    def __init__(self, build, recipe, folder):
        torch.manual_seed(0)
        model, batches, loss_fn, self.example, self.mask = build()
        self.model = dal.prepare_qat(model, recipe=recipe, hardware="a2000", example_inputs=batches[0])
        dal.calibrate(self.model, batches)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        loss = loss_fn(self.model, batches[1])
        loss.backward()
        torch.optim.SGD(params, lr=1e-2).step()
        self.loss = loss.item()
        self.moved = sum(not torch.equal(a, p) for a, p in zip(before, params))
        self.model.eval()
        self.path = str(folder / "model.onnx")
        dal.export_onnx(self.model, self.example, self.path)
        self.report = dal.verify(self.path, self.model, self.example)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each case is prepared, trained, exported and verified once for the whole module."""
    cache = {}

    def get(name):
        if name not in cache:
            build, recipe = CASES[name]
            cache[name] = Deployed(build, recipe, tmp_path_factory.mktemp(name))
        return cache[name]
    return get


@pytest.fixture(scope="module", params=list(CASES))
def deployed(request, built):
    return built(request.param)


def _int64_compare_nodes(path):
    """Compare / mask nodes with an int64 (or bool-from-int64) operand after shape inference."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    for n in model.graph.node:
        if n.op_type == "Constant":
            types[n.output[0]] = n.attribute[0].t.data_type
    compare = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal", "And", "Or", "Not"}
    return [n.name for n in model.graph.node
            if n.op_type in compare and any(types.get(i) == onnx.TensorProto.INT64 for i in n.input)]


def test_encoder_exports_and_verifies(deployed):
    """The one verdict passes, onnxruntime ran layer by layer, and the QAT step trained."""
    r = deployed.report
    assert np.isfinite(deployed.loss) and deployed.moved > 0
    assert r.integer is not None and r.integer.identical, str(r.integer)
    assert r.integer.elements > 0 and r.integer.codes > 0
    assert r.layers_forced, "onnxruntime did not run layer by layer"
    assert all(row.passes for row in r.layers_forced)
    differ, total, worst = r.layer_by_layer()
    assert total > 0 and worst <= 1, (differ, total, worst)
    assert r.verdict(), r.verdict_line()
    assert _int64_compare_nodes(deployed.path) == []


@pytest.fixture(scope="module")
def bert(built):
    return built("bert-w8a8_llm")


@pytest.fixture(scope="module", params=["bert-w8a8_llm", "distilbert-int8_balanced"])
def masked(request, built):
    return built(request.param)


def test_additive_mask_is_transformers_own_mask(masked):
    """The oracle is transformers' handling of the 2-D padding mask: the same logits, bit for bit."""
    bert = masked
    ids, bias = bert.example
    with torch.no_grad():
        from_2d = bert.model(ids, bert.mask).logits
        from_bias = bert.model(ids, bias).logits
        unmasked = bert.model(ids, torch.zeros_like(bias)).logits
    assert torch.equal(from_2d, from_bias)
    assert not torch.equal(from_bias, unmasked)


def test_npu_ignores_padded_tokens(masked):
    """On dal.npu, changing the token ids under the padding changes no output; dropping the mask does."""
    bert = masked
    ids, bias = bert.example
    sess = dal.npu.load(bert.path)
    other = ids.clone()
    other[1, PAD_FROM:] = (other[1, PAD_FROM:] + 17) % 256  # row 1's padding
    base = sess.run([ids.numpy(), bias.numpy()])[0]
    assert np.array_equal(base, sess.run([other.numpy(), bias.numpy()])[0])
    assert not np.array_equal(base, sess.run([other.numpy(), np.zeros_like(bias.numpy())])[0])


def test_2d_mask_is_refused_naming_what_to_pass(bert):
    ids, _ = bert.example
    with pytest.raises(ExportError, match=r"(?s)example input 1 is attention_mask.*additive_attention_mask"):
        dal.export_onnx(bert.model, (ids, bert.mask))


def test_additive_attention_mask_formula_and_bad_input():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    bias = additive_attention_mask(mask)
    low = torch.finfo(torch.float32).min
    assert bias.shape == (2, 1, 1, 3) and bias.dtype == torch.float32
    assert bias[:, 0, 0].tolist() == [[0.0, 0.0, low], [0.0, low, low]]
    with pytest.raises(ValueError, match=r"2-D \[batch, length\].*\(2, 1, 3\)"):
        additive_attention_mask(mask[:, None])
    with pytest.raises(ValueError, match="float dtype"):
        additive_attention_mask(mask, dtype=torch.int32)
