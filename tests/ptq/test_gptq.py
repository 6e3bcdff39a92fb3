"""dal.ptq.gptq against a float64 reference of GPTQ written in the test (second_order_ref.py),
on a 16x64 INT4 per-group-32 layer with 64 calibration rows; then a whole tiny Llama."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from torch import nn

import dal
from dal.ptq import gptq

from second_order_ref import (W4_GROUP, first_differences_are_ties, output_error, prepared_small_layer, reference,
                              rtn_per_group, small_layer)


def tiny_llama_config(layers: int):
    T = pytest.importorskip("transformers")
    return T, T.LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=256, max_position_embeddings=128)


def codes_and_scales(q):
    mod = q[0]
    wq = mod.weight_quant
    s = wq.scale.detach().double()
    w = mod.quantized_weight(mod.weight).detach().double()
    codes = torch.round(w / s.repeat_interleave(32, dim=1)).numpy()  # w is code * s in float32
    return codes, s.numpy(), w.numpy()


@pytest.mark.parametrize("act_order", [False, True])
def test_float64_run_equals_the_reference_in_codes_and_scales(act_order):
    q, W, X = prepared_small_layer()
    report = gptq(q, [X], dtype=torch.float64, act_order=act_order, block_size=16)
    ref = reference(W, X.double().numpy(), act_order=act_order)
    codes, scales, _ = codes_and_scales(q)
    # Both are float64 from the same data: they differ only in rounding of order 1e-13 (Cholesky
    # and lazy block updates vs elimination), which would flip a code only for a value within
    # 1e-13 of a tie. So: 0 LSB, every code; the scales are the float32 values, bit for bit.
    assert np.array_equal(codes, ref["codes"])
    assert np.array_equal(scales, ref["scales"])
    assert report["layers"]["0"]["error"] < report["layers"]["0"]["rtn_error"]
    # the exported / integer-model codes: the quantizer is frozen and gives the same weight back
    assert q[0].weight_quant.state == "frozen"


def test_the_layers_fake_quant_weight_is_gptqs_quantized_weight_exactly():
    q, W, X = prepared_small_layer()
    gptq(q, [X])
    mod = q[0]
    s = mod.weight_quant.scale.detach().repeat_interleave(32, dim=1)
    fq = mod.quantized_weight(mod.weight).detach()
    codes = torch.round(mod.weight.detach() / s)
    assert torch.equal(fq, mod.weight.detach())  # the written weight is on the grid
    assert torch.equal(fq, codes * s)
    assert float(codes.abs().max()) <= 8


def test_default_float32_run_matches_the_reference_up_to_first_flips_at_ties():
    q, W, X = prepared_small_layer()
    gptq(q, [X])  # float32 arithmetic, lazy blocks of 128
    ref = reference(W, X.double().numpy())
    codes, _, _ = codes_and_scales(q)
    # float32 rounding (1e-7 relative) can flip a code whose float64 value lies within about
    # 1e-5 LSB of a tie (tolerance 1e-3 LSB); after such a flip the row's later codes follow
    # other errors, so only each row's first difference is checked.
    assert first_differences_are_ties(codes, ref) == []
    assert (codes == ref["codes"]).mean() > 0.9


def test_gptq_beats_round_to_nearest_on_the_layer_output():
    q, W, X = prepared_small_layer()
    Xd = X.double().numpy()
    err_rtn = output_error(Xd, W, rtn_per_group(W))
    gptq(q, [X])
    _, _, Q = codes_and_scales(q)
    err = output_error(Xd, W, Q)
    assert err < 0.9 * err_rtn, (err, err_rtn)


def test_act_order_beats_round_to_nearest_too():
    q, W, X = prepared_small_layer(seed=1)
    Xd = X.double().numpy()
    gptq(q, [X], act_order=True)
    _, _, Q = codes_and_scales(q)
    assert output_error(Xd, W, Q) < output_error(Xd, W, rtn_per_group(W))


def test_dead_columns_quantize_to_zero():
    lin, X = small_layer(2)
    X[:, 5] = 0.0
    W = lin.weight.detach().double().numpy().copy()
    q = dal.prepare_qat(nn.Sequential(lin), recipe=W4_GROUP, example_inputs=(X[:4],))
    dal.calibrate(q, [X])
    gptq(q, [X], dtype=torch.float64)
    codes, _, _ = codes_and_scales(q)
    assert np.all(codes[:, 5] == 0)
    assert np.array_equal(codes, reference(W, X.double().numpy())["codes"])


def test_uncalibrated_model_is_refused_naming_the_layer():
    lin, X = small_layer()
    q = dal.prepare_qat(nn.Sequential(lin), recipe=W4_GROUP, example_inputs=(X[:4],))
    with pytest.raises(ValueError, match=r"weight quantizer of 0 has no scale.*dal\.calibrate"):
        gptq(q, [X])


def test_model_without_a_supported_layer_is_refused_naming_it():
    class DepthwiseOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, groups=4)  # grouped: no single input Hessian

        def forward(self, x):
            return self.conv(x)

    x = torch.randn(2, 4, 8, 8)
    q = dal.prepare_qat(DepthwiseOnly(), recipe="int8_balanced", example_inputs=(x,))
    dal.calibrate(q, [x])
    with pytest.raises(ValueError, match=r"DepthwiseOnly has no QLinear \(or plain QConv2d\)"):
        gptq(q, [x])


def test_conv2d_over_unfolded_patches_equals_the_reference():
    W4_CONV = {"name": "w4_conv_pc", "rules": [
        {"type": ["conv"], "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True,
                                      "observer": "minmax"}}]}
    g = torch.Generator().manual_seed(3)
    conv = nn.Conv2d(4, 8, 3, padding=1, stride=2)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(8, 4, 3, 3, generator=g) * 0.1)
    x = torch.randn(16, 4, 9, 9, generator=g)
    W = conv.weight.detach().double().reshape(8, -1).numpy().copy()
    # the rows the weight matrix multiplies: torch's own unfold (in * kh * kw patches)
    rows = torch.nn.functional.unfold(x.double(), 3, padding=1, stride=2).transpose(1, 2).reshape(-1, 36)
    q = dal.prepare_qat(nn.Sequential(conv), recipe=W4_CONV, example_inputs=(x[:2],))
    dal.calibrate(q, [x])
    report = gptq(q, [x], dtype=torch.float64)
    ref = reference(W, rows.numpy(), per_channel=True)
    mod = q[0]
    s = mod.weight_quant.scale.detach().double().reshape(-1, 1)
    codes = torch.round(mod.quantized_weight(mod.weight).detach().double().reshape(8, -1) / s).numpy()
    assert np.array_equal(codes, ref["codes"])  # 0 LSB, as for the linear layer
    assert np.array_equal(s.numpy()[:, 0], ref["scales"][:, 0])  # per channel: the calibrated scales
    assert report["layers"]["0"]["tokens"] == rows.shape[0]
    assert report["layers"]["0"]["error"] < report["layers"]["0"]["rtn_error"]


def test_bad_arguments_are_named():
    q, W, X = prepared_small_layer()
    with pytest.raises(ValueError, match="percdamp"):
        gptq(q, [X], percdamp=0.0)
    with pytest.raises(ValueError, match="sequential"):
        gptq(q, [X], sequential="model")
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        gptq(q, [X], layers=["nope"])


@pytest.fixture(scope="module")
def llama_ids():
    T, cfg = tiny_llama_config(2)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
    return T.LlamaForCausalLM(cfg), ids


def test_whole_tiny_llama_gptq_then_a_qat_step(llama_ids):
    import copy

    model, ids = llama_ids
    p = dal.prepare_qat(copy.deepcopy(model), recipe="w4a8_fp8_performance", hardware="a2000")
    dal.calibrate(p, ids)
    report = gptq(p, ids)
    layers = report["layers"]
    # every linear of both decoder layers (int4 per group) and the int8 lm_head
    assert len(layers) == 2 * 7 + 1
    assert sum(r["error"] for r in layers.values()) < sum(r["rtn_error"] for r in layers.values())
    assert report["passes"] == 2  # one per decoder layer (lm_head joins the last)
    q_proj = p.model.layers[0].self_attn.q_proj
    assert q_proj.weight_quant.granularity.block_size == 32
    assert torch.equal(q_proj.quantized_weight(q_proj.weight), q_proj.weight)
    p.train()
    opt = torch.optim.SGD(p.parameters(), lr=1e-3)
    loss = p(ids[0], labels=ids[0]).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert torch.isfinite(p(ids[1], labels=ids[1]).loss)


def test_replaying_solved_blocks_gives_the_same_model_as_full_passes():
    T, cfg = tiny_llama_config(3)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]

    def run(**kwargs):
        torch.manual_seed(0)
        p = dal.prepare_qat(T.LlamaForCausalLM(cfg), recipe="w4a8_fp8_performance", hardware="a2000")
        dal.calibrate(p, ids, method="minmax")  # the cheapest: only the equality of the runs matters here
        return p, gptq(p, ids, **kwargs)

    a, rep_a = run()
    b, rep_b = run(replay=False)
    assert (rep_a["passes"], rep_a["replayed"]) == (3, 1)  # the third block's pass replays the first
    assert rep_b["replayed"] == 0
    lin_a = {n: m for n, m in a.named_modules() if isinstance(m, nn.Linear)}
    for n, m in b.named_modules():
        if isinstance(m, nn.Linear):
            assert torch.equal(m.weight, lin_a[n].weight), n
            assert torch.equal(m.weight_quant.scale, lin_a[n].weight_quant.scale), n
    from dal.ptq.hessian import candidate_linears, input_groups, stages

    groups = input_groups(a, candidate_linears(a), ids, None)
    assert [len(g.names) for g in groups[:4]] == [3, 1, 2, 1]  # q/k/v share an input, o, gate/up, down
    assert len(stages(groups, "layer")) == 3 * 4 + 1  # sequential="layer": a pass per shared input
    assert len(stages(groups, "block")) == 3  # lm_head joins the last decoder layer's pass


def test_gptq_is_a_step_of_the_ptq_flow():
    lin, X = small_layer()
    manual, _, _ = prepared_small_layer()
    gptq(manual, [X])
    flow = dal.ptq.quantize_ptq(nn.Sequential(lin), W4_GROUP, [X], steps=["gptq"], example_inputs=(X[:4],))
    assert torch.equal(flow[0].weight, manual[0].weight)
    assert torch.equal(flow[0].weight_quant.scale, manual[0].weight_quant.scale)
    with pytest.raises(ValueError, match="unknown PTQ step"):
        dal.ptq.quantize_ptq(nn.Sequential(lin), W4_GROUP, [X], steps=["gptq2"], example_inputs=(X[:4],))


def test_gptq_model_is_closer_to_the_float_model_than_round_to_nearest_on_held_out_tokens():
    T, cfg = tiny_llama_config(2)
    g = torch.Generator().manual_seed(1)
    # 1024 calibration tokens: more rows than any linear's input width (with fewer, H is
    # rank-deficient and GPTQ fits the calibration tokens at the expense of others)
    ids = [torch.randint(0, 256, (8, 32), generator=g) for _ in range(4)]
    held = torch.randint(0, 256, (4, 16), generator=g)
    torch.manual_seed(1)
    with torch.no_grad():
        ref = T.LlamaForCausalLM(cfg).eval()(held).logits
    err = {}
    for name in ("rtn", "gptq"):
        torch.manual_seed(1)
        p = dal.prepare_qat(T.LlamaForCausalLM(cfg), recipe="w4a8_fp8_performance", hardware="a2000")
        dal.calibrate(p, ids)
        if name == "gptq":
            gptq(p, ids)
        with torch.no_grad():
            err[name] = float((p.eval()(held).logits - ref).norm())
    assert err["gptq"] < 0.95 * err["rtn"], err


@pytest.mark.parametrize("act_order", [False, True])
def test_a_layer_already_2_of_4_keeps_its_mask(act_order):
    lin, X = small_layer()
    net = dal.sparsity.prepare_sparse(nn.Sequential(lin), "2:4")
    mask = lin.weight_mask.clone()
    W = lin.weight.detach().double().numpy().copy()  # pruned entries are 0 already
    q = dal.prepare_qat(net, recipe=W4_GROUP, example_inputs=(X[:4],))
    dal.calibrate(q, [X])
    gptq(q, [X], dtype=torch.float64, act_order=act_order)
    codes, _, _ = codes_and_scales(q)
    assert torch.equal(q[0].weight_mask, mask)
    assert np.all(codes[~mask.numpy()] == 0)
    ref = reference(W, X.double().numpy(), act_order=act_order, fixed_mask=mask.numpy())
    assert np.array_equal(codes, ref["codes"])


def test_the_exported_codes_and_scales_are_gptqs(tmp_path):
    import onnx
    from onnx import numpy_helper

    q, W, X = prepared_small_layer()
    gptq(q, [X], dtype=torch.float64)
    ref = reference(W, X.double().numpy())
    path = tmp_path / "gptq.onnx"
    dal.export_onnx(q, (X[:4],), str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    assert np.array_equal(inits["0.weight_quant.codes"].astype(np.float64), ref["codes"])
    assert np.array_equal(inits["0.weight_quant.scale"].astype(np.float64), ref["scales"])


def test_a_half_precision_weight_is_refused_by_path():
    q, W, X = prepared_small_layer()
    q[0].weight.data = q[0].weight.data.bfloat16()
    with pytest.raises(ValueError, match="0 has a torch.bfloat16 weight"):
        gptq(q, [X])


def test_an_unusable_hessian_names_the_layer():
    q, W, X = prepared_small_layer()
    # one calibration row: H has rank 1, and a damping of 1e-30 of its mean diagonal does not help
    with pytest.raises(ValueError, match=r"dal.ptq: 0: the layer's Hessian is not positive definite"):
        gptq(q, [X[:1]], percdamp=1e-30)
