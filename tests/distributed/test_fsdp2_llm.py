"""FSDP2 (``fully_shard`` per decoder layer plus the root, two gloo processes on CPU) trains a
tiny LlamaForCausalLM prepared with the W4A8 recipe (INT4 weights per group of 32 along the
input, the last linear INT8 per channel), and its weight quantizers' state stays that of an
unsharded run.

The reference is one process with no FSDP2 (``fsdp2_llm_workers._train_reference``): the same
calibrated model, the same steps, each rank's half of a batch run as a micro-batch, gradients
accumulated and halved. Expected bit for bit (``torch.equal``), because:

* FSDP2 all-gathers a layer's full weights (exact copies) before its forward, so rank ``r`` runs
  the reference's micro-batch ``r`` forward and backward on the same tensors and shapes;
* the gradient mean: FSDP2's ``g0 / 2 + g1 / 2`` (gloo) and the reference's ``(g0 + g1) / 2`` are
  both one rounding of the sum and an exact halving;
* SGD is elementwise, so a shard's step is the unsharded step on those elements;
* weight observers (per group, per channel) see the full weight on every rank, and their
  all-reduces over equal values change nothing; activation scales are frozen after calibration
  so the reference's micro-batches are quantized with the ranks' scales (activation observers
  across ranks with different data: tests/distributed/test_fsdp2.py).

Modes (``fsdp2_llm_workers.recipe_for``): ``recipe`` (observed weight scales, buffers, never
sharded), ``lsq`` (learnable weight scales left whole by ``replicate_quantizer_parameters``),
``lsq-sharded`` (learnable per-group / per-channel scales sharded along dim 0 with their weights,
kept in range by a small learning rate), ``lsq-sharded-projected`` (sharded too, at a rate that
pushes a scale below MIN_SCALE, projected on the shards by ``project_quantizer_parameters``; the
reference projects after its steps too, where its forward would have: the same numbers).
``recipe-live`` (activation observers updating in the steps, each rank on different data): the
ranks' quantizer state agrees bit for bit (the observers' all-reduces).
"""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")

from ddp_common import free_port  # noqa: E402
from fsdp2_llm_workers import LIVE, MODES, STEPS, llm_worker  # noqa: E402

pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]

GROUP = 32
PER_GROUP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEAR_SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
                 "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
                 "mlp.down_proj": (64, 128)}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp2_llm")
    mp.spawn(llm_worker, args=(2, free_port(), str(path)), nprocs=2, join=True)
    return path


def _runs(out, mode):
    fsdp = [torch.load(out / mode / f"fsdp_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return fsdp, torch.load(out / mode / "ref.pt", weights_only=False)


def _per_group_keys():
    return [f"model.layers.{i}.{name}.weight_quant.scale" for i in (0, 1) for name in PER_GROUP]


@pytest.mark.parametrize("mode", MODES)
def test_weights_are_sharded_and_scales_follow_the_mode(out, mode):
    fsdp, _ = _runs(out, mode)
    sharded = mode.startswith("lsq-sharded")
    for run in fsdp:
        local = run["local_shapes"]
        for i in (0, 1):
            for name, (rows, cols) in LINEAR_SHAPES.items():
                prefix = f"model.layers.{i}.{name}"
                assert local[f"{prefix}.weight"] == (rows // 2, cols)  # dim 0, half per rank
                scale = local.get(f"{prefix}.weight_quant.scale")
                # a rank's shard of a per-group scale holds the groups of its own weight rows
                assert scale == ((rows // 2, cols // GROUP) if sharded else None)
        assert local.get("lm_head.weight_quant.scale") == ((128,) if sharded else None)
        # the gathered per-group scales: one per group of 32 along the input of the full weight
        for s in range(STEPS):
            for i in (0, 1):
                for name, (rows, cols) in LINEAR_SHAPES.items():
                    assert run["quant"][s][f"model.layers.{i}.{name}.weight_quant.scale"].shape == (rows, cols // GROUP)
            assert run["quant"][s]["lm_head.weight_quant.scale"].shape == (256,)


@pytest.mark.parametrize("mode", MODES)
def test_gathered_weight_quantizer_state_equals_the_unsharded_run(out, mode):
    """After every step, each rank's gathered quantizer state (scale, zero point, observer range:
    per group for the decoder linears, per channel for lm_head and the embedding, per tensor for
    activations) == the unsharded run's."""
    fsdp, ref = _runs(out, mode)
    for s in range(STEPS):
        keys = ref["quant"][s].keys()
        assert set(_per_group_keys()) | {"lm_head.weight_quant.scale"} <= set(keys)
        for run in fsdp:
            assert run["quant"][s].keys() == keys
            assert [k for k in keys if not torch.equal(run["quant"][s][k], ref["quant"][s][k])] == []
    # not a comparison of constants: every per-group and per-channel weight scale moved in training
    first, last = ref["quant"][0], ref["quant"][-1]
    moved = [k for k in [*_per_group_keys(), "lm_head.weight_quant.scale"] if not torch.equal(first[k], last[k])]
    assert len(moved) == len(PER_GROUP) * 2 + 1


@pytest.mark.parametrize("mode", MODES)
def test_each_ranks_loss_equals_the_unsharded_micro_batch_loss(out, mode):
    fsdp, ref = _runs(out, mode)
    for s in range(STEPS):
        for r, run in enumerate(fsdp):
            assert torch.equal(run["loss"][s], ref["loss"][s][r])


def test_live_activation_observers_agree_across_ranks(out):
    """Activation observers updating in every step, each rank on its own half of the batch:
    FSDP2 does not synchronise buffers, the observers' all-reduces do; the ranks agree on every
    quantizer's state after every step, and activation scales did move in training."""
    r0, r1 = (torch.load(out / LIVE / f"fsdp_rank{r}.pt", weights_only=False) for r in (0, 1))
    for a, b in zip(r0["quant"], r1["quant"]):
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    acts = [k for k in r0["quant"][0] if k.endswith(".scale") and "weight_quant" not in k]
    assert any(not torch.equal(r0["quant"][0][k], r0["quant"][-1][k]) for k in acts)
    assert not torch.equal(r0["loss"][0], r1["loss"][0])  # the ranks saw different data


def test_learned_scales_stayed_above_min_scale(out):
    """The condition under which ``lsq-sharded`` equals the unsharded run: no step pushed a
    learned scale below MIN_SCALE, so the forward's in-place projection (lost on a sharded
    scale's all-gathered copy; README, FSDP2) never ran."""
    from dal.formats.qparams import MIN_SCALE

    _, ref = _runs(out, "lsq-sharded")
    for state in ref["quant"]:
        for k, v in state.items():
            if k.endswith(".scale"):
                assert bool((v >= MIN_SCALE).all()), k


def test_projection_reaches_the_shards(out):
    """``lsq-sharded-projected``: a step did push a learned scale below MIN_SCALE (the reference
    holds MIN_SCALE exactly there), and each rank's gathered shards hold the projected value
    after that step and the next ones (the state equality above then covers the later steps)."""
    from dal.formats.qparams import MIN_SCALE

    fsdp, ref = _runs(out, "lsq-sharded-projected")
    hit = [s for s, state in enumerate(ref["quant"]) if bool((state["lm_head.weight_quant.scale"] == MIN_SCALE).any())]
    assert hit and hit[0] < STEPS - 1  # projected before the last step, so a later step starts from it
    for run in fsdp:
        for state in run["quant"][hit[0]:]:
            assert all(bool((v >= MIN_SCALE).all()) for k, v in state.items() if k.endswith(".scale"))


def test_project_quantizer_parameters_in_one_process():
    """The hook's projection: after ``step()`` a scale below MIN_SCALE is MIN_SCALE, a learnable
    zero point out of [qmin, qmax] is clamped into it, values in range are untouched."""
    from dal.formats import per_channel
    from dal.formats.qparams import MIN_SCALE
    from dal.observers.distributed import project_quantizer_parameters
    from dal.quantizer import FakeQuantizer

    q = FakeQuantizer("int8", per_channel(0), symmetric=False, learnable=True)
    q.set_qparams(torch.tensor([-1.0, 0.5, 0.0]), torch.tensor([300.0, -5.0, -129.0]))
    opt = torch.optim.SGD(q.parameters(), lr=0.0)
    handle = project_quantizer_parameters(opt, q)
    opt.step()
    assert torch.equal(q.scale.detach(), torch.tensor([MIN_SCALE, 0.5, MIN_SCALE]))
    assert torch.equal(q.zero_point.detach(), torch.tensor([127.0, -5.0, -128.0]))
    handle.remove()
    q.scale.data.fill_(-2.0)
    opt.step()
    assert bool((q.scale == -2.0).all())  # removed: no projection
