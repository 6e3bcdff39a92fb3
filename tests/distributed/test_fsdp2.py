"""FSDP2 (``torch.distributed.fsdp.fully_shard``, two gloo processes on CPU) trains a prepared model.

MnistCNN (int8_balanced, a2000) is prepared and calibrated, then sharded per QAT layer plus the
root, or on the root only, and trained for a few SGD steps on rank-dependent batches; the same run
under DDP is the reference. What is checked:

* FSDP2 shards the weights (a rank holds half of each) but all-gathers them before a module's
  forward: every weight quantizer is called with the full weight, and its per-channel buffers
  (scale, zero point, observer min / max) have one entry per output channel of the full weight —
  not the shard's (the trap: per-channel buffers at full length next to a sharded weight).
* Quantizer buffers are identical on every rank (FSDP2 does not broadcast buffers; the observers'
  all-reduces keep them equal).
* The trained state (weights, scales, observer ranges) equals DDP's bit for bit.
* The full state dict loads into a freshly prepared model, which exports.
* Calibrating before or after ``fully_shard`` gives the same state.
* Learnable (LSQ) scales: ``fully_shard`` refuses the 0-dim ones;
  ``dal.observers.distributed.replicate_quantizer_parameters`` leaves every quantizer parameter
  whole (gradients averaged over ranks), and training equals DDP's bit for bit; sharding the
  per-channel ones instead loses the forward's in-place projection of the scales.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from ddp_common import differing, free_port, is_bn_running_stat
from fsdp2_workers import LAYERS, STEPS, fsdp2_worker

pytestmark = [pytest.mark.xdist_group("ddp"), pytest.mark.slow]

FSDP2 = ["fsdp2-per-layer", "fsdp2-root"]
QUANT_BUFFERS = (".scale", ".zero_point", ".observer.min_val", ".observer.max_val")


@pytest.fixture(scope="session")
def out(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(fsdp2_worker, args=(2, free_port(), str(path)), nprocs=2, join=True)
    return path


def _load(out, mode, name):
    return torch.load(out / mode / name, weights_only=False)


@pytest.mark.parametrize("mode", FSDP2)
def test_weights_are_sharded_but_quantizers_see_full_weights(out, mode):
    full = _load(out, mode, "full_rank0.pt")
    for rank in (0, 1):
        trace = _load(out, mode, f"trace_rank{rank}.pt")
        for name in LAYERS:
            w = full[f"{name}.weight"]
            # between forwards a rank holds half of the output channels (dim 0) ...
            assert trace["local_shapes"][f"{name}.weight"] == (w.shape[0] // 2, *w.shape[1:])
            # ... yet every call of the weight quantizer (calibration, then each step) got all of them
            assert trace["seen"][name] == [tuple(w.shape)] * len(trace["seen"][name])
            assert len(trace["seen"][name]) >= STEPS
            for suffix in QUANT_BUFFERS:
                assert full[f"{name}.weight_quant{suffix}"].shape == (w.shape[0],), suffix


@pytest.mark.parametrize("mode", FSDP2)
def test_weight_observer_range_is_that_of_the_full_weights(out, mode):
    """Oracle from torch's own reductions: the head's (running) min-max weight observer saw the
    calibration weight and the weight before each of the steps (all the same full tensors on every
    rank, gathered here with ``DTensor.full_tensor``): its range is their per-row amin / amax."""
    for rank in (0, 1):
        full = _load(out, mode, f"full_rank{rank}.pt")
        ws = torch.stack(_load(out, mode, f"trace_rank{rank}.pt")["head_weights"])  # (STEPS, 10, 288)
        assert ws.shape[0] == STEPS and not torch.equal(ws[0], ws[-1])  # the weights did train
        assert torch.equal(full["head.weight_quant.observer.min_val"], ws.amin(dim=(0, 2)))
        assert torch.equal(full["head.weight_quant.observer.max_val"], ws.amax(dim=(0, 2)))


@pytest.mark.parametrize("mode", FSDP2)
def test_ranks_hold_identical_quantizer_buffers(out, mode):
    r0, r1 = _load(out, mode, "full_rank0.pt"), _load(out, mode, "full_rank1.pt")
    quant = [k for k in r0 if k.endswith(QUANT_BUFFERS)]
    assert len(quant) >= 4 * (2 * len(LAYERS) + 2)  # input and weight quantizers, the add's two inputs
    assert all(r0[k].numel() for k in quant)  # calibrated: no lazy buffer left empty
    # Everything but BN running statistics agrees; those are each rank's own (FSDP2, like DDP
    # with broadcast_buffers=False, does not synchronise buffers), and do differ.
    assert differing(r0, r1, skip=is_bn_running_stat) == []
    assert differing(r0, r1) != []


@pytest.mark.parametrize("mode", FSDP2)
def test_fsdp2_trains_exactly_as_ddp(out, mode):
    """Bit for bit, every tensor of the state dict on each rank, DDP(broadcast_buffers=False) as
    the reference. Exact because each rank runs the same forward / backward on the same batch
    with the same full weights (FSDP2 all-gathers them), and with two ranks the gradient mean
    (g0 + g1) / 2 is one commutative rounding and an exact halving whichever collective computes
    it; observers then see identical tensors. (Not compared with one process over the union of
    the batches: BN normalises by each rank's own batch statistics in both DDP and FSDP2.)"""
    for rank in (0, 1):
        f, d = _load(out, mode, f"full_rank{rank}.pt"), _load(out, "ddp", f"full_rank{rank}.pt")
        assert differing(f, d) == []
        assert any(k.endswith("weight_quant.scale") for k in f)


def test_full_state_dict_loads_into_a_fresh_model_and_exports(out, tmp_path):
    import dal
    from dal_examples.zoo import MnistCNN

    sd = _load(out, "fsdp2-per-layer", "full_rank0.pt")
    x = torch.randn(2, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(width=8), "int8_balanced", "a2000", example_inputs=(x,))
    model.load_state_dict(sd)
    assert differing(sd, model.state_dict()) == []
    model.eval()
    proto = dal.export_onnx(model, (x,), tmp_path / "fsdp2.onnx")
    inits = [np.asarray(i.float_data if i.float_data else np.frombuffer(i.raw_data, np.float32))
             for i in proto.graph.initializer if i.data_type == 1]
    head_scale = sd["head.weight_quant.scale"].numpy()
    assert any(a.shape == head_scale.shape and np.array_equal(a, head_scale) for a in inits)


def test_fully_shard_refuses_scalar_learnable_scales(out):
    # torch's own refusal of a calibrated LSQ model's per-tensor (0-dim) learnable scales
    assert "doesn't support scalar parameters" in (out / "lsq_refusal.txt").read_text()


def test_learnable_scales_stay_whole_and_train_exactly_as_ddp(out):
    """LSQ with ``replicate_quantizer_parameters`` as ``ignored_params``: weights sharded, every
    quantizer parameter whole on each rank; ranks agree; state == DDP's bit for bit (same
    argument as above: the hook's (g0 + g1) / 2 is DDP's mean)."""
    local = _load(out, "fsdp2-lsq", "trace_rank0.pt")["local_shapes"]
    assert "head.weight" in local and not [k for k in local if "_quant" in k]
    r0, r1 = _load(out, "fsdp2-lsq", "full_rank0.pt"), _load(out, "fsdp2-lsq", "full_rank1.pt")
    assert differing(r0, r1, skip=is_bn_running_stat) == []
    for rank, f in enumerate((r0, r1)):
        assert differing(f, _load(out, "ddp-lsq", f"full_rank{rank}.pt")) == []


def _lsq_model(calibrated: bool):
    import dal
    from dal_examples.zoo import MnistCNN
    from ddp_workers import _lsq_recipe

    x = torch.randn(16, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(width=8), _lsq_recipe(), "a2000", example_inputs=(x[:2],))
    if calibrated:
        dal.calibrate(model, [x], progress=False)
    return model


def test_replicate_quantizer_parameters_refuses_an_uncalibrated_model():
    from dal.observers.distributed import replicate_quantizer_parameters

    with pytest.raises(ValueError, match=r"'stem\.0\..*scale' is empty .*calibrate"):
        replicate_quantizer_parameters(_lsq_model(calibrated=False))


def test_replicate_quantizer_parameters_in_one_process():
    """The quantizers' parameters and nothing else; in one process the hook leaves gradients as
    autograd computed them (compared with a clone's, no hook)."""
    import copy

    import dal
    from dal.observers.distributed import replicate_quantizer_parameters
    from dal_examples.zoo import MnistCNN

    model = _lsq_model(calibrated=True)
    twin = copy.deepcopy(model)
    whole = replicate_quantizer_parameters(model)
    names = {n for n, p in model.named_parameters() if any(p is q for q in whole)}
    assert names and all("_quant" in n for n in names)
    assert {n for n in dict(model.named_parameters()) if n.endswith("_quant.scale")} <= names
    assert replicate_quantizer_parameters(model) == whole  # idempotent, one hook per parameter
    x = torch.randn(4, 1, 28, 28)
    for m in (model, twin):
        m(x).square().sum().backward()
    grads = dict(twin.named_parameters())
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert names & set(trained)  # some hooked parameter did get a gradient
    assert all(torch.equal(p.grad, grads[n].grad) if p.grad is not None else grads[n].grad is None
               for n, p in model.named_parameters())
    plain = dal.prepare_qat(MnistCNN(width=8), "int8_balanced", "a2000", example_inputs=(x[:2],))
    assert replicate_quantizer_parameters(plain) == set()


def test_sharded_learnable_scales_lose_the_forwards_projection(out):
    """Why ``replicate_quantizer_parameters`` leaves per-channel learnable scales whole: sharded with
    their weights (only the 0-dim ones left whole, with the same gradient mean), the forward's
    in-place projection of a scale an SGD step pushed below MIN_SCALE writes into FSDP2's
    temporary all-gathered copy, and the sharded parameter keeps the unprojected value. The
    forward still uses the projected scale, so weights, activation scales and ranks all agree;
    the stored per-channel weight scales alone part from DDP's, lower (each step starts from the
    unprojected value)."""
    f, d = _load(out, "fsdp2-lsq-sharded-scales", "full_rank0.pt"), _load(out, "ddp-lsq", "full_rank0.pt")
    assert differing(f, _load(out, "fsdp2-lsq-sharded-scales", "full_rank1.pt"), skip=is_bn_running_stat) == []
    lost = sorted(differing(f, d))
    assert lost == sorted(f"{name}.weight_quant.scale" for name in LAYERS)
    assert all(bool((f[k] <= d[k]).all()) and bool((f[k] < d[k]).any()) for k in lost)


def test_shard_then_calibrate_equals_calibrate_then_shard(out):
    # without learnable scales, calibrating the sharded model gives the same state bit for bit
    for rank in (0, 1):
        assert differing(_load(out, "fsdp2-shard-then-calibrate", f"full_rank{rank}.pt"),
                         _load(out, "fsdp2-per-layer", f"full_rank{rank}.pt")) == []
