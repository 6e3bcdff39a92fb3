"""dal.ptq.sparsegpt (2:4 jointly with INT4 per group) against a float64 reference of SparseGPT
written in the test (second_order_ref.py), on a 16x64 layer with 64 calibration rows."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import dal
from dal.ptq import sparsegpt
from second_order_ref import (GROUP, W4_GROUP, group_scale, output_error, prepared_small_layer, reference, rtn,
                              small_layer)


def magnitude_then_rtn(W):
    """Keep the 2 largest |w| of every 4 consecutive inputs per row, then INT4 RTN with min-max
    group scales of the pruned weights."""
    groups = np.abs(W).reshape(W.shape[0], -1, 4)
    keep = np.zeros_like(groups, dtype=bool)
    np.put_along_axis(keep, np.argsort(-groups, axis=2, kind="stable")[:, :, :2], True, axis=2)
    P = np.where(keep.reshape(W.shape), W, 0.0)
    Q = np.empty_like(P)
    for c in range(0, W.shape[1], GROUP):
        Q[:, c:c + GROUP] = rtn(P[:, c:c + GROUP], group_scale(P[:, c:c + GROUP])[:, None])[0]
    return Q


def layer_result(q):
    mod = q[0]
    s = mod.weight_quant.scale.detach().double().repeat_interleave(GROUP, dim=1)
    Q = mod.quantized_weight(mod.weight).detach().double()
    return torch.round(Q / s).numpy(), Q.numpy(), mod.weight_mask.numpy()


def test_float64_run_equals_the_reference_in_mask_codes_and_scales():
    q, W, X = prepared_small_layer()
    sparsegpt(q, [X], dtype=torch.float64, block_size=16)
    ref = reference(W, X.double().numpy(), sparsity=(2, 4))
    codes, _, mask = layer_result(q)
    # float64 both: 0 LSB on every code (a flip needs a value within ~1e-13 of a tie or of a
    # mask score tie); the mask and the float32 scales are identical.
    assert np.array_equal(mask, ref["mask"])
    assert np.array_equal(codes, ref["codes"])
    assert np.array_equal(q[0].weight_quant.scale.double().numpy(), ref["scales"])


def test_the_mask_is_2_of_4_and_the_weight_is_sparsegpts_result():
    q, W, X = prepared_small_layer()
    sparsegpt(q, [X])
    codes, Q, mask = layer_result(q)
    mod = q[0]
    assert mask.dtype == bool and mask.shape == W.shape
    assert (mask.reshape(16, 16, 4).sum(-1) == 2).all()
    assert (codes[~mask] == 0).all()
    assert dal.sparsity.is_2to4(mod.quantized_weight(mod.weight).detach(), 1)
    assert torch.equal(mod.quantized_weight(mod.weight), mod.weight)  # the weight is on the grid
    assert float(mod.weight_sparsity_stats[2]) < float(mod.weight_sparsity_stats[1])


def test_sparsegpt_beats_magnitude_pruning_then_round_to_nearest():
    q, W, X = prepared_small_layer()
    Xd = X.double().numpy()
    sparsegpt(q, [X])
    _, Q, _ = layer_result(q)
    err, err_mag = output_error(Xd, W, Q), output_error(Xd, W, magnitude_then_rtn(W))
    assert err < 0.9 * err_mag, (err, err_mag)


def test_export_lists_the_weight_as_2_of_4(tmp_path):
    q, W, X = prepared_small_layer()
    sparsegpt(q, [X])
    path = tmp_path / "sparse.onnx"
    dal.export_onnx(q, (X[:4],), str(path))
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert "0.weight_quant" in meta.get("dal.sparse_24", "")


def test_width_not_a_multiple_of_m_is_named():
    lin = nn.Linear(6, 4)
    x = torch.randn(8, 6)
    rec = dict(W4_GROUP, rules=[dict(W4_GROUP["rules"][0], weight=dict(W4_GROUP["rules"][0]["weight"],
                                                                          granularity="per_channel"))])
    rec["rules"][0]["weight"].pop("group_size")
    rec["rules"][0]["weight"].pop("axis")
    q = dal.prepare_qat(nn.Sequential(lin), recipe=rec, example_inputs=(x,))
    dal.calibrate(q, [x])
    with pytest.raises(ValueError, match="sparsegpt: 0: 6 input features are not a multiple of 4"):
        sparsegpt(q, [x])


def test_whole_tiny_llama_sparsegpt_then_a_qat_step():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256, max_position_embeddings=128)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
    p = dal.prepare_qat(T.LlamaForCausalLM(cfg), recipe="w4a8_fp8_performance", hardware="a2000")
    dal.calibrate(p, ids)
    report = sparsegpt(p, ids)
    assert len(report["layers"]) == 7 + 1
    down = p.model.layers[0].mlp.down_proj
    assert dal.sparsity.is_2to4(down.quantized_weight(down.weight).detach(), 1)
    p.train()
    loss = p(ids[0], labels=ids[0]).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert down.weight.grad[~down.weight_mask].abs().max() == 0  # pruned weights get no gradient


def test_sparsegpt_is_a_step_of_the_ptq_flow():
    lin, X = small_layer()
    q = dal.ptq.quantize_ptq(nn.Sequential(lin), W4_GROUP, [X], steps=["sparsegpt"], example_inputs=(X[:4],))
    mod = q[0]
    assert (mod.weight_mask.reshape(16, 16, 4).sum(-1) == 2).all()
    assert torch.equal(mod.quantized_weight(mod.weight), mod.weight)


def test_latent_weights_are_the_values_the_loop_rounded():
    # latent=True: the same masks and codes as the reference, and each stored weight is the reference's
    # compensated weight just before rounding (v * s), not its grid point: QAT moves codes from there
    q, W, X = prepared_small_layer()
    sparsegpt(q, [X], dtype=torch.float64, block_size=16, latent=True)
    ref = reference(W, X.double().numpy(), sparsity=(2, 4))
    codes, Q, mask = layer_result(q)
    assert np.array_equal(mask, ref["mask"])
    assert np.array_equal(codes, ref["codes"])
    s = q[0].weight_quant.scale.detach().double().repeat_interleave(GROUP, dim=1).numpy()
    lat = q[0].weight.detach().double().numpy()
    # float64 solve, float32 weight: one float32 rounding of v * s (relative 6e-8)
    np.testing.assert_allclose(lat, np.where(ref["mask"], ref["v"] * s, 0.0), rtol=1e-6, atol=1e-9)
    assert (lat[mask] != Q[mask]).mean() > 0.9  # off the grid points


def test_a_layer_pruned_at_prepare_is_refused_before_anything_changes():
    # a recipe rule's sparsity: 2:4 prunes by magnitude at prepare_qat: SparseGPT would only pick among the kept weights
    lin, X = small_layer()
    rec = {**W4_GROUP, "rules": [dict(W4_GROUP["rules"][0], sparsity="2:4")]}
    q = dal.prepare_qat(nn.Sequential(lin), recipe=rec, example_inputs=(X[:4],))
    dal.calibrate(q, [X])
    w0 = q[0].weight.detach().clone()
    assert not bool(q[0].weight_mask.all())
    with pytest.raises(ValueError, match="sparsegpt: 0: the weight is already pruned by its weight_mask"):
        sparsegpt(q, [X])
    assert torch.equal(q[0].weight, w0)


def test_sparsegpt_masks_survive_training_steps():
    q, W, X = prepared_small_layer()
    sparsegpt(q, [X], latent=True)
    mod = q[0]
    mask = mod.weight_mask.clone()
    opt = torch.optim.AdamW(q.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        (q(X) - X[:, :16]).square().mean().backward()
        opt.step()
    assert torch.equal(mod.weight_mask, mask)
    assert mod.weight[~mask].abs().max() == 0
    assert dal.sparsity.is_2to4(mod.quantized_weight(mod.weight).detach(), 1)
