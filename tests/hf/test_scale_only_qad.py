"""Scale-only QAT and quantization-aware distillation (QAD) on a tiny LlamaForCausalLM
(transformers, built from its config; hidden 64, 2 layers, vocab 256, sequence 16).

* Scale-only (recipe ``w4a8_lsq_scales_only``, ``train: scales_only``, INT4 per channel; and
  ``w4a8_fp8_llm`` made scale-only here: ``train: scales_only``, every scale learnable, INT4 per
  group of 32, fp8 activations): only quantizer scales and zero points get gradients; every
  weight (and every other parameter) stays bit-identical through the steps; the loss on a fixed
  batch goes down.
* QAD (recipe ``w4a8_fp8_llm``): the float model, deep-copied before ``prepare_qat``, teaches its
  quantized copy with ``dal.distill.KDLoss(..., class_dim=-1)`` (KL over the vocabulary of every
  token, HF ``ModelOutput``s taken as they are); the KL on a fixed batch goes down. The KL itself
  is checked against a float64 formula written here from torch's own softmax.
"""
from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

T = pytest.importorskip("transformers")

import dal  # noqa: E402
from dal.distill import KDLoss, kd_divergence  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 20


def _tiny_llama(initializer_range: float = 0.02):
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256, max_position_embeddings=128,
                        initializer_range=initializer_range)
    return T.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _llm_scales_only() -> dict:
    rec = dal.load_recipe("w4a8_fp8_llm").to_dict()
    rec.update(name="w4a8_fp8_llm_scales_only", train="scales_only")
    for rule in rec["rules"]:
        for role in ("weight", "input"):
            if isinstance(rule.get(role), dict):
                rule[role] = dict(rule[role], learnable=True)
    return rec


@pytest.fixture(scope="module", params=["w4a8_lsq_scales_only", "w4a8_fp8_llm_scales_only"])
def scale_only_run(request, ids):
    recipe = request.param if request.param == "w4a8_lsq_scales_only" else _llm_scales_only()
    model = dal.prepare_qat(_tiny_llama(), recipe, "a2000")
    dal.calibrate(model, [ids], progress=False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # the user's loop: every parameter
    losses, with_grad = [], set()
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        with_grad |= {n for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(float(loss.detach()))
    return model, frozen, start, losses, with_grad, request.param


def test_scale_only_trains_only_quantizer_parameters(scale_only_run):
    model, frozen, start, _, with_grad, recipe = scale_only_run
    names = dict(model.named_parameters())
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 7 + 1
    assert {f"{n}.weight" for n in linears} <= set(frozen)  # every weight frozen ...
    assert "model.embed_tokens.weight" in frozen and "model.norm.weight" in frozen
    from dal.quantizer import quantizers

    owned = {f"{q}.{n}" for q, m in quantizers(model) for n, _ in m.named_parameters()}
    assert start and set(start) <= owned  # ... only quantizer parameters train
    assert with_grad == set(start)  # and exactly those got gradients
    assert {f"{n}.weight_quant.scale" for n in linears} <= with_grad
    for n in linears:  # int4 per output channel (per group of 32) in the decoder, int8 per channel for lm_head
        rows, cols = names[f"{n}.weight"].shape
        per_group = recipe == "w4a8_fp8_llm_scales_only" and n != "lm_head"
        assert names[f"{n}.weight_quant.scale"].shape == ((rows, cols // 32) if per_group else (rows,))


def test_scale_only_keeps_weights_bit_identical_and_moves_the_scales(scale_only_run):
    model, frozen, start, _, _, _ = scale_only_run
    now = dict(model.named_parameters())
    assert [n for n, w in frozen.items() if not torch.equal(now[n], w)] == []
    moved = {n for n, s in start.items() if not torch.equal(now[n], s)}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert {f"{n}.weight_quant.scale" for n in linears} <= moved


def test_scale_only_loss_decreases_on_a_fixed_batch(scale_only_run):
    losses = scale_only_run[3]
    assert losses[-1] < losses[0]
    assert min(losses[-5:]) < min(losses[:5])


def _kl_float64(student_logits, teacher_logits, mask=None):
    """KL(softmax(t) || softmax(s)) over the last axis, float64, mean over the kept tokens."""
    s, t = student_logits.detach().double(), teacher_logits.detach().double()
    p_t = torch.softmax(t, -1)
    kl = (p_t * (torch.log(p_t) - torch.log(torch.softmax(s, -1)))).sum(-1)
    return kl.mean() if mask is None else kl[mask.bool()].mean()


@pytest.fixture(scope="module")
def qad_run(ids):
    # wider initial weights than HF's 0.02: a random 0.02 model's logits are near uniform, so
    # its quantized copy's KL is ~2e-4 and the distillation has little to do
    float_model = _tiny_llama(initializer_range=0.1)
    teacher = copy.deepcopy(float_model)  # before prepare_qat swaps modules in place
    student = dal.prepare_qat(float_model, "w4a8_fp8_llm", "a2000")
    dal.calibrate(student, [ids], progress=False)
    loss_fn = KDLoss(teacher, T=1.0, alpha=1.0, class_dim=-1)
    opt = torch.optim.Adam(student.parameters(), lr=1e-4)
    kls, first = [], None
    for _ in range(8):
        opt.zero_grad()
        out = student(ids)  # a CausalLMOutputWithPast
        kl = loss_fn.distill_term(out, ids)
        if first is None:
            first = (out.logits.detach().clone(), loss_fn.teacher_logits(ids), kl.detach().clone())
        kl.backward()
        opt.step()
        kls.append(float(kl.detach()))
    return student, teacher, kls, first


def test_qad_kl_is_the_per_token_kl_over_the_vocabulary(qad_run):
    student_logits, teacher_logits, kl = qad_run[3]
    assert student_logits.shape == (4, 16, 256)
    want = _kl_float64(student_logits, teacher_logits)
    assert float(want) > 1e-3  # the quantized student does differ from its teacher
    # float32 bound: each token's KL is sum_v p_v * (log p_t - log p_s), the two float32 log-softmax
    # values off by a few ulp of |log p| each, and the weights p_v sum to 1
    bound = 4 * torch.finfo(torch.float32).eps * float(torch.log_softmax(teacher_logits.double(), -1).abs().max())
    assert abs(float(kl) - float(want)) <= bound
    # the mask keeps some tokens: the mean is over those
    mask = torch.zeros(4, 16, dtype=torch.long)
    mask[:, :9] = 1
    got = kd_divergence(student_logits, teacher_logits, T=1.0, class_dim=-1, mask=mask)
    want_masked = _kl_float64(student_logits, teacher_logits, mask)
    assert abs(float(got) - float(want_masked)) <= bound
    assert abs(float(want_masked) - float(want)) > bound  # the masked mean is another number


def test_qad_kl_decreases_on_a_fixed_batch(qad_run):
    kls = qad_run[2]
    assert kls[-1] < 0.75 * kls[0]


def test_qad_teacher_is_untouched_float(qad_run):
    from dal.quantizer import quantizers

    student, teacher = qad_run[0], qad_run[1]
    assert list(quantizers(teacher)) == [] and list(quantizers(student))
    assert not teacher.training


def test_kd_divergence_refuses_a_bad_class_dim_or_mask():
    s = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="class_dim=3"):
        kd_divergence(s, s, class_dim=3)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5\)"):
        kd_divergence(s, s, class_dim=-1, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="keeps no position"):
        kd_divergence(s, s, class_dim=-1, mask=torch.zeros(2, 3))
