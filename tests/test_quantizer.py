"""FakeQuantizer: states, persistence, repr, learnable scale, errors."""
import pytest
import torch

import dal
import dal.formats as F
from dal.quantizer import FakeQuantizer


def _calibrated(fmt="int8", **kw):
    fq = FakeQuantizer(fmt, **kw)
    fq(torch.linspace(-3, 3, 100))
    return fq


def test_states_behave_as_documented():
    torch.manual_seed(0)
    fq = FakeQuantizer("int8", observer="minmax", name="layer1.act")
    assert fq.state == "observe"
    x = torch.randn(50) * 2
    assert fq(x) is x and fq.observer.has_data                       # observe: identity, observer sees it
    fq.end_observation("quantize")                                    # leaving observe computes qparams
    s0 = float(fq.scale)
    assert s0 == pytest.approx(float(x.abs().max()) / 127)
    y = fq(x)
    assert torch.equal(y, F.fake_quantize(x, "int8", fq.scale, fq.zero_point))
    fq(x * 10)                                                        # quantize + training: min-max keeps updating
    assert float(fq.scale) == pytest.approx(10 * s0, rel=1e-6)
    fq.eval()
    fq(x * 100)                                                       # ...but not in eval
    assert float(fq.scale) == pytest.approx(10 * s0, rel=1e-6)
    fq.train().set_state("frozen")
    batches = int(fq.observer.batches_seen)
    y = fq(x * 1000)                                                  # frozen: fixed parameters, observer off
    assert int(fq.observer.batches_seen) == batches and float(fq.scale) == pytest.approx(10 * s0, rel=1e-6)
    assert float(y.max()) == pytest.approx(127 * 10 * s0, rel=1e-6)
    fq.set_state("off")
    assert fq(x) is x
    with pytest.raises(ValueError, match="state='bogus'"):
        fq.set_state("bogus")


def test_fp16_quantizer_states():
    fq = FakeQuantizer("fp16")
    x = torch.tensor([1.0 + 2 ** -12, 70000.0])
    assert fq(x) is x                                                 # observe: unchanged
    fq.set_state("quantize")                                          # a cast has no scale to compute
    assert fq(x).tolist() == [1.0, float("inf")]                      # a cast round trip


def test_error_before_calibration_names_the_quantizer():
    fq = FakeQuantizer("int4", name="encoder.layers.3.fc1.weight_quantizer")
    with pytest.raises(RuntimeError, match=r"encoder\.layers\.3\.fc1\.weight_quantizer \(int4\).*calibrate"):
        fq.set_state("quantize")
    sd = {**fq.state_dict(), "state_code": torch.tensor(1, dtype=torch.int8)}
    fq.eval().load_state_dict(sd)  # a checkpoint that says "quantize" without a scale (eval: no min-max update)
    with pytest.raises(RuntimeError, match=r"encoder\.layers\.3\.fc1\.weight_quantizer has no scale"):
        fq(torch.randn(3))


@pytest.mark.parametrize("kw", [
    dict(fmt="int8"), dict(fmt="uint8", symmetric=False), dict(fmt="int4", granularity=F.per_channel(0)),
    dict(fmt="fp8_e4m3", observer="percentile"), dict(fmt="int8", observer="kl"),
    dict(fmt="uint8", symmetric=False, learnable=True), dict(fmt="int4", granularity=F.per_group(1, 4)),
    dict(fmt="int8", granularity=F.per_channel(0), learnable=True)])
def test_state_dict_round_trips_exactly_into_a_fresh_quantizer(kw):
    torch.manual_seed(1)
    fmt = kw.pop("fmt")
    fq = FakeQuantizer(fmt, **kw)
    for _ in range(3):
        fq(torch.randn(6, 8))
    fq.end_observation("frozen")
    sd = fq.state_dict()
    fresh = FakeQuantizer(fmt, **kw)
    fresh.load_state_dict(sd)
    assert fresh.state == "frozen"
    for k, v in fresh.state_dict().items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k
    x = torch.randn(6, 8)
    assert torch.equal(fq(x), fresh(x))


def test_readable_repr():
    fq = FakeQuantizer("int8", F.per_channel(0), observer="minmax", name="fc")
    assert "int8, per_channel(axis=0), symmetric, observer=minmax, state=observe" in repr(fq)
    fq(torch.randn(4, 3))
    fq.end_observation("frozen")
    assert "state=frozen" in repr(fq) and "scale=[4 values" in repr(fq)
    assert "scale=" in repr(_calibrated("fp8_e4m3").end_observation("frozen"))


def test_learnable_scale_trains():
    torch.manual_seed(2)
    x = torch.randn(4096) * 2
    fq = FakeQuantizer("int4", learnable=True)
    fq(x)
    fq.end_observation("quantize")
    with torch.no_grad():
        fq.scale.mul_(4.0)  # start far from a good step size
    opt = torch.optim.Adam([fq.scale], lr=0.05)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = ((fq(x) - x) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    assert fq.scale.grad is not None and float(fq.scale.detach()) > 0


def test_learned_scale_and_zero_point_pushed_out_of_range_are_projected_back():
    """An optimizer step can leave a learnable scale <= 0 or an LSQ+ zero point outside the
    format's codes; the next forward (and the exporter) project them back into range."""
    torch.manual_seed(3)
    x = torch.rand(512) * 4 - 1
    fq = FakeQuantizer("uint8", symmetric=False, learnable=True)
    fq(x)
    fq.end_observation("quantize")
    with torch.no_grad():
        fq.scale.fill_(-0.5)
        fq.zero_point.fill_(300.0)
    y = fq(x)
    assert float(fq.scale.detach()) > 0 and float(fq.zero_point.detach()) == 255.0
    # the output is what a uint8 quantizer with those (projected) parameters computes
    expected = (torch.clamp(torch.round(x / fq.scale.detach()) + 255, 0, 255) - 255) * fq.scale.detach()
    assert torch.equal(y, expected)
    assert not fq.project_learned_qparams_()  # in range now: nothing to change


def test_learnable_quantizer_called_twice_in_one_forward_still_backpropagates():
    fq = FakeQuantizer("int8", learnable=True)
    x = torch.randn(64, requires_grad=True)
    fq(x.detach())
    fq.end_observation("quantize")
    (fq(x) + fq(2 * x)).sum().backward()  # the projection must not invalidate saved tensors
    assert fq.scale.grad is not None and x.grad is not None


def test_export_projects_a_learned_scale_left_out_of_range(tmp_path):
    import onnx
    from torch import nn

    import dal
    from dal.nn import QLinear, SimpleLayerSpec, SimpleTensorSpec

    spec = SimpleLayerSpec(weight=SimpleTensorSpec("int8", "per_channel", learnable=True),
                           input=SimpleTensorSpec("int8", learnable=True))
    # no bias: its int32 codes at the projected s_in would not fit, and export refuses that
    layer = QLinear.from_float(nn.Linear(8, 4, bias=False), spec, "fc")
    x = torch.randn(16, 8)
    layer(x)
    for q in (layer.input_quant, layer.weight_quant):
        q.end_observation("frozen")
    with torch.no_grad():
        layer.input_quant.scale.fill_(-1.0)  # as a last optimizer step might leave it
    proto = dal.export_onnx(layer.eval(), (x,), str(tmp_path / "fc.onnx"))
    scales = [onnx.numpy_helper.to_array(i) for i in proto.graph.initializer if i.name.endswith("input_quant.scale")]
    assert scales and all((s > 0).all() for s in scales)


def test_set_state_only_sets_the_state():
    """Observing then ``set_state`` changes nothing but the state: the scale stays what it was
    until ``compute_qparams`` / ``end_observation`` asks the observer (the float64 oracle is
    the observed range over 127)."""
    fq = FakeQuantizer("int8", observer="minmax")
    fq(torch.full((4,), 2.0))
    fq.end_observation("frozen")
    assert float(fq.scale) == pytest.approx(2.0 / 127)
    fq.set_state("observe")
    fq(torch.full((4,), 8.0))
    fq.set_state("quantize")                                          # no recomputation
    assert float(fq.scale) == pytest.approx(2.0 / 127)
    fq.compute_qparams()                                              # explicit
    assert float(fq.scale) == pytest.approx(8.0 / 127)
    assert fq.state == "quantize" and fq.state is dal.QState.QUANTIZE and fq.state.code == 1


def test_quantizer_states_restores_each_quantizers_own_state():
    from torch import nn

    model = nn.Sequential(FakeQuantizer("int8"), FakeQuantizer("int8"), FakeQuantizer("fp16"))
    model(torch.randn(8))
    model[0].end_observation("frozen")
    model[1].end_observation("quantize")
    x = torch.randn(8)
    before = model(x)
    with pytest.raises(KeyError):
        with dal.quantizer_states(model, "off") as qs:
            assert len(qs) == 3 and all(q.state == "off" for q in qs)
            assert torch.equal(model(x), x)
            raise KeyError("an exception inside the block")
    assert [q.state for q in model] == ["frozen", "quantize", "observe"]
    assert torch.equal(model(x), before)


def test_state_survives_a_checkpoint_round_trip_into_the_forward():
    """The forward reads a mirror of the ``state_code`` buffer: loading a state_dict must
    update it, or a loaded frozen quantizer would keep observing."""
    fq = _calibrated().end_observation("frozen")
    fresh = FakeQuantizer("int8")
    fresh.load_state_dict(fq.state_dict())
    assert fresh.state == "frozen"
    x = torch.linspace(-5, 5, 11)
    assert torch.equal(fresh(x), fq(x)) and not torch.equal(fresh(x), x)
