"""A tensor read by two quantizers of one state is fake-quantized once (dal.formats.share):
the same bits as computing it twice, outputs, every gradient and every buffer.

The reference is the same model with the memo switched off (``sharing(False)``): each
quantizer then runs its own C++ call, which tests/test_quantizer_fast_path.py compares with the
torch path. A shared output is recognised by its storage (``data_ptr``) being the partner's.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision

import dal
from dal.formats import native
from dal.formats.share import sharing, sharing_enabled
from dal.quantizer import FakeQuantizer, quantizer_states

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")

PAIRS = [("layer1.0.conv1.input_quant", "layer1.0.add.input_quants.1"),
         ("layer2.0.conv1.input_quant", "layer2.0.downsample.0.input_quant")]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32) if t.dtype == torch.float32 else t.detach()


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), f"{what} differs"


def _resnet():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    m = dal.prepare_qat(torchvision.models.resnet18(weights=None), recipe="int8_balanced", hardware="a2000",
                        example_inputs=(x[:2],))
    dal.calibrate(m, [x[:2], x[2:]], progress=False)
    return m.train(), x


def _outputs(model) -> tuple[dict, list]:
    """Hooks recording each quantizer's output storage pointer, by module path."""
    seen, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, FakeQuantizer):
            hooks.append(mod.register_forward_hook(lambda m, i, o, n=name: seen.__setitem__(n, o.data_ptr())))
    return seen, hooks


def _steps(model, x, share: bool, n: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    y = torch.arange(x.shape[0]) % 10
    seen, hooks = _outputs(model)
    outs, grads = [], []
    with sharing(share):
        for _ in range(n):
            opt.zero_grad()
            out = model(x)
            F.cross_entropy(out, y).backward()
            outs.append(out.detach().clone())
            grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
            opt.step()
    for h in hooks:
        h.remove()
    return outs, grads, seen


def _versions(model) -> dict:
    return {k: t._version for k, t in model.named_buffers()}


def _compare(a, b, x, n=2):
    va, vb = _versions(a), _versions(b)
    (oa, ga, seen_a), (ob, gb, seen_b) = _steps(a, x, True, n), _steps(b, x, False, n)
    # autograd's version counters of the buffers move as the computed calls move them
    assert {k: v - va[k] for k, v in _versions(a).items()} == {k: v - vb[k] for k, v in _versions(b).items()}
    for i in range(n):
        _same(oa[i], ob[i], f"output of step {i}")
        assert ga[i].keys() == gb[i].keys()
        for k in ga[i]:
            _same(ga[i][k], gb[i][k], f"step {i}: grad of {k}")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        _same(sa[k], sb[k], f"buffer {k}")
    return seen_a, seen_b


@pytest.mark.parametrize("state", ["quantize", "frozen"])
def test_resnet18_same_bits_with_and_without_sharing(state):
    a, x = _resnet()
    if state == "frozen":
        for _, q in dal.quantizer.quantizers(a):
            q.set_state("frozen") if q.state == "quantize" else None
    b = copy.deepcopy(a)
    seen_a, seen_b = _compare(a, b, x)
    for first, second in PAIRS:
        assert seen_a[first] == seen_a[second], f"{second} did not share {first}'s output"
        assert seen_b[first] != seen_b[second]


def test_observe_state_and_eval_same_bits():
    a, x = _resnet()
    b = copy.deepcopy(a)
    with quantizer_states(a, "observe"), quantizer_states(b, "observe"):
        _compare(a, b, x, n=1)
    a.eval(), b.eval()
    with torch.no_grad():
        with sharing(True):
            ya = a(x)
        with sharing(False):
            yb = b(x)
    _same(ya, yb, "eval output")
    with torch.inference_mode():  # inference tensors have no version counter: computed, not shared
        yc = a(x)
        yd = a(torch.clone(x))  # an inference tensor as the input
    _same(yc, yb, "inference-mode output")
    _same(yd, yb, "inference-mode output on an inference tensor")


@pytest.mark.parametrize("state", ["quantize", "frozen"])
def test_a_pair_whose_qparams_differ_does_not_share(state):
    a, x = _resnet()
    first, second = PAIRS[0]
    q = a.get_submodule(second)
    with torch.no_grad():
        if state == "frozen":
            q.set_qparams(q.scale * 2, q.zero_point)
        else:
            q.observer.max_val.mul_(3)  # a wider running range: the step's scale differs
    for _, fq in dal.quantizer.quantizers(a):
        if state == "frozen" and fq.state == "quantize":
            fq.set_state("frozen")
    b = copy.deepcopy(a)
    seen_a, _ = _compare(a, b, x)
    assert seen_a[first] != seen_a[second]
    assert seen_a[PAIRS[1][0]] == seen_a[PAIRS[1][1]]  # the other pairs still share


def test_in_place_write_between_the_calls_is_computed_again():
    torch.manual_seed(1)
    q1, q2 = FakeQuantizer("int8"), FakeQuantizer("int8")
    x = torch.randn(4, 64)
    for q in (q1, q2):
        q(x)
        q.end_observation("frozen")
    y1 = q1(x)
    y2 = q2(x)
    assert y1.data_ptr() == y2.data_ptr() and y1 is not y2
    x.mul_(2)
    y3 = q2(x)
    assert y3.data_ptr() != y1.data_ptr()
    with sharing(False):
        _same(y3, q2(x), "after the in-place write")
    assert sharing_enabled()


def test_gradient_of_the_shared_input_is_each_quantizer_masked_on_its_own():
    # Gradients of opposite signs through a clipped element: masking each one gives +0 + -0 = +0
    # where masking their sum would give -0.
    q1, q2 = FakeQuantizer("int8"), FakeQuantizer("int8")
    calib = torch.linspace(-1, 1, 16)
    for q in (q1, q2):
        q(calib)
        q.end_observation("frozen")
    x = torch.tensor([5.0, 0.5, -7.0, 0.25]).requires_grad_()
    y1, y2 = q1(x), q2(x)
    assert y1.data_ptr() == y2.data_ptr()
    (y1 * torch.tensor([-2.0, 1.0, 3.0, 1.0]) + y2 * torch.tensor([1.0, 1.0, -4.0, 1.0])).sum().backward()
    expect = torch.tensor([0.0, 2.0, 0.0, 2.0])
    _same(x.grad, expect, "gradient")


def test_export_is_byte_identical(tmp_path):
    a, x = _resnet()
    a.eval()
    with sharing(True):
        p1 = dal.export_onnx(a, (x[:1],), tmp_path / "a.onnx").SerializeToString()
    with sharing(False):
        p2 = dal.export_onnx(a, (x[:1],), tmp_path / "b.onnx").SerializeToString()
    assert p1 == p2
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_a_quantizer_whose_results_nobody_takes_stops_recording_them():
    """After share.PROBE_CALLS untaken entries a quantizer stops recording (speed only): the
    pairs still share, and every output, gradient and buffer keeps the bits of no sharing."""
    from dal.formats.share import PROBE_CALLS

    a, x = _resnet()
    b = copy.deepcopy(a)
    seen_a, _ = _compare(a, b, x, n=PROBE_CALLS + 2)
    for first, second in PAIRS:
        assert seen_a[first] == seen_a[second], f"{second} stopped sharing {first}'s output"
    stats = {n: q._share_stats for n, q in dal.quantizer.quantizers(a) if q._share_stats.recorded}
    stopped = [n for n, s in stats.items() if not s.records()]
    assert stopped and all(stats[n].recorded == PROBE_CALLS and stats[n].taken == 0 for n in stopped)
    assert all(s.records() for s in stats.values() if s.taken)
    assert all(stats[first].taken >= PROBE_CALLS + 2 for first, _ in PAIRS)
