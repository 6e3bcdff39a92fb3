"""LoRA + QAT with peft: peft's LoRA Linear trains as one fake-quantized linear with the merged weight.

Oracles: peft's own ``merge()`` (the merged weight that deploys), torch's autograd (which
parameters get gradients), and the plain QLinear that the merged layer becomes.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import dal  # noqa: E402

T = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj"]


def tiny_llama():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256, max_position_embeddings=128)
    return T.LlamaForCausalLM(cfg)


def lora_model(dropout=0.0):
    # init_lora_weights=False: B is random, not zero, so the LoRA path changes the weight from step 0
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout, init_lora_weights=False)
    return peft.get_peft_model(tiny_llama(), config)


def lora_layers(model):
    from dal.nn.lora import QLoraLinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, QLoraLinear)]


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=["int8_balanced", "w4a8_lsq"])
def trained(request, ids):
    """A LoRA model prepared (peft first, then dal), calibrated and trained for two SGD steps."""
    model = dal.prepare_qat(lora_model(), recipe=request.param, hardware="a2000")
    dal.calibrate(model, [ids, ids], progress=False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    grads = {}
    for _ in range(2):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        opt.step()
    dal.set_quantizer_state(model, "frozen")
    return model.eval(), grads, request.param


def test_every_lora_linear_is_one_qat_module(trained):
    model, _, _ = trained
    layers = lora_layers(model)
    assert sorted(n.rsplit(".", 1)[-1] for n, _ in layers) == sorted(TARGETS * 2)
    for name, mod in layers:  # its base and LoRA linears are not quantized separately
        inner = [n for n, m in mod.named_modules() if n and isinstance(m, dal.nn.QATModule)]
        assert inner == [], f"{name}: {inner}"
        assert mod.weight_quant is not None and mod.input_quant is not None


def test_gradients_reach_only_lora_and_quantizers(trained):
    model, grads, recipe = trained
    lora = {n for n in grads if ".lora_A." in n or ".lora_B." in n}
    quant = {n for n in grads if "_quant." in n}
    assert set(grads) == lora | quant
    assert len(lora) == 2 * 2 * len(TARGETS)  # A and B of each target in each layer
    if recipe == "w4a8_lsq":  # learnable scales: the quantizers of the LoRA layers train too
        assert any(n.split(".weight_quant.")[0].endswith(tuple(TARGETS)) for n in quant), sorted(quant)
    else:
        assert not quant


def test_merged_weight_is_pefts_merge_bit_for_bit(trained):
    from dal.nn.lora import merged_qlinear

    model, _, _ = trained
    for name, mod in lora_layers(model):
        oracle = copy.deepcopy(mod.to_float())  # peft's own layer with the trained A, B, W
        oracle.merge(safe_merge=True)
        merged_w = oracle.get_base_layer().weight.detach()
        assert torch.equal(mod.merged_weight().detach(), merged_w), name
        fq = mod.quantized_weight(mod.merged_weight()).detach()
        assert torch.equal(fq, mod.weight_quant(merged_w).detach()), name
        plain = merged_qlinear(mod)
        assert type(plain) is dal.nn.QLinear
        assert torch.equal(plain.quantized_weight(plain.weight).detach(), fq), name
        x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(2))
        assert torch.equal(plain(x), mod(x)), name


def test_merge_lora_keeps_the_model_bit_for_bit(trained, ids):
    from dal.nn.lora import merge_lora

    model, _, _ = trained
    model = copy.deepcopy(model)
    with torch.no_grad():
        before = model(ids).logits
        merged = merge_lora(model)
        after = merged(ids).logits
    assert lora_layers(merged) == []
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    assert torch.equal(before, after)


def test_pefts_own_merge_is_refused(trained):
    model, _, _ = trained
    with pytest.raises(RuntimeError, match=r"q_proj: peft's merge would drop dal's quantizers.*merge_lora"):
        copy.deepcopy(model).merge_and_unload()


def test_lora_dropout_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj.*lora_dropout=0\.1.*lora_dropout=0\.0"):
        dal.prepare_qat(lora_model(dropout=0.1), recipe="int8_balanced", hardware="a2000")


def test_peft_after_prepare_is_refused():
    from dal.nn.lora import refuse_lora_around_qat

    prepared = dal.prepare_qat(tiny_llama(), recipe="int8_balanced", hardware="a2000")
    wrapped = peft.get_peft_model(prepared, peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
    with pytest.raises(ValueError, match=r"applied after dal\.prepare_qat.*q_proj.*Apply peft first"):
        refuse_lora_around_qat(wrapped)


class TinyLM(torch.nn.Module):
    """Embedding -> Linear -> ReLU -> Linear: a model dal exports whole (the tiny Llama does not yet)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc1, self.fc2 = torch.nn.Embedding(256, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 256)

    def forward(self, input_ids):
        return self.fc2(torch.relu(self.fc1(self.emb(input_ids))))


def test_merged_export_computes_what_the_lora_model_trained(ids, tmp_path):
    """The ONNX of the merged model, run by onnxruntime (optimizations off), against the LoRA QAT model in torch,
    in LSBs of the output quantizer."""
    pytest.importorskip("onnxruntime")
    from oracles import lsb_diff, output_scale, run_ort

    from dal.nn.lora import merge_lora

    config = peft.LoraConfig(r=4, target_modules=["fc1", "fc2"], lora_dropout=0.0, init_lora_weights=False)
    model = dal.prepare_qat(peft.get_peft_model(TinyLM(), config), recipe="int8_balanced", hardware="a2000",
                            example_inputs=(ids,), quantize_outputs=True)
    assert len(lora_layers(model)) == 2
    dal.calibrate(model, [ids, ids.flip(0)], progress=False)
    dal.set_quantizer_state(model, "frozen")
    with torch.no_grad():
        trained = model.eval()(ids).numpy()
    merged = merge_lora(copy.deepcopy(model))
    assert type(merged) is TinyLM and type(merged.fc1) is dal.nn.QLinear
    path = tmp_path / "merged.onnx"
    dal.export_onnx(merged, (ids,), str(path))
    (deployed,) = run_ort(str(path), {"input": ids.numpy()})
    assert lsb_diff(deployed, trained, output_scale(path)).max() <= 1
