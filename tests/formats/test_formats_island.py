"""The fused FP16 island (dal.formats.island) against the ops it replaces, bit for bit: the FP16
round trip of the input (``fake_quantize(x, "fp16")``), torch's own float32 F.hardswish /
F.hardsigmoid, the round trip of the output, and autograd through the three (torch's
hardswish_backward / hardsigmoid_backward at ``h16(x)``). Inputs: random values, every float16
value and every rounding midpoint +-1 ulp, the clip points -3 / 3 and their neighbours, zeros of
both signs, float16 and float32 subnormals, the largest finite values; gradients with NaN, inf
and -0; scalar tails and two threads. Where the fused path declines (NaN or inf after rounding,
layouts, tracing, switched off) the island runs the ops one by one; a step of a real
torchvision MobileNetV3 gives the same outputs, gradients and state_dict with it on and off."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.formats import fake_quantize, fp_cast, island, native
from dal.prepare import fp16_island

pytestmark = pytest.mark.skipif(island.library() is None or native.library() is None,
                                reason=f"no island kernel: {island.status()}")

ACTS = {"hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _assert_bits(got, want):
    if not torch.equal(_bits(got), _bits(want)):
        bad = (_bits(got) != _bits(want)).reshape(-1).nonzero()
        i = int(bad[0])
        raise AssertionError(f"{bad.numel()} values differ, e.g. [{i}]: {got.reshape(-1)[i].item()!r} vs "
                             f"{want.reshape(-1)[i].item()!r}")


def _reference(x, op):
    """The island as the ops one by one: what dal.prepare.fp16_island ran before the fused path."""
    return fake_quantize(ACTS[op](fake_quantize(x, "fp16")), "fp16")


def _both(x, g, op):
    """(fused y, fused grad, reference y, reference grad) for input x and incoming gradient g."""
    a = x.clone().requires_grad_()
    y = island.fused_island(a, op)
    assert y is not None, island.status()
    y.backward(g)
    b = x.clone().requires_grad_()
    y_ref = _reference(b, op)
    y_ref.backward(g)
    return y, a.grad, y_ref, b.grad


def _from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _edges():
    """Every float16 value and midpoint (+-1 float32 ulp), the clip points, zeros, subnormals."""
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    v = torch.unique(codes[torch.isfinite(codes)]).double()
    mid = ((v[1:] + v[:-1]) / 2).float()
    pts = torch.cat([v.float(), mid])
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    clip = torch.tensor([-6.0, -3.0, 0.0, 3.0, 6.0, -0.0, 65504.0, -65504.0, 65519.99, -65519.99])
    clip = torch.cat([clip, torch.nextafter(clip, up), torch.nextafter(clip, down)])
    f32_sub = _from_bits(list(range(1, 1 << 23, 7919)))
    pts = torch.cat([pts, torch.nextafter(pts, up), torch.nextafter(pts, down), clip, f32_sub, -f32_sub])
    return pts[torch.isfinite(pts.half().float())]


@pytest.mark.parametrize("op", sorted(ACTS))
@pytest.mark.parametrize("source", ["normal", "edges"])
def test_fused_matches_the_ops_one_by_one(op, source):
    g_ = torch.Generator().manual_seed(1)
    x = torch.randn(200_003, generator=g_) * 4 if source == "normal" else _edges()
    g = torch.randn(x.shape, generator=g_)
    y, gx, y_ref, gx_ref = _both(x, g, op)
    _assert_bits(y, y_ref)
    _assert_bits(gx, gx_ref)


@pytest.mark.parametrize("op", sorted(ACTS))
def test_special_gradients(op):
    """NaN, +-inf and -0 in the incoming gradient go through torch's expressions unchanged."""
    x = torch.tensor([-4.0, -3.0, -1.5, -0.0, 0.0, 1.0, 2.99, 3.0, 5.0] * 3)
    g = torch.tensor([float("nan")] * 9 + [float("inf")] * 4 + [-float("inf")] * 5 + [-0.0] * 9)
    y, gx, y_ref, gx_ref = _both(x, g, op)
    _assert_bits(y, y_ref)
    assert torch.equal(torch.isnan(gx), torch.isnan(gx_ref))
    keep = ~torch.isnan(gx_ref)
    _assert_bits(gx[keep], gx_ref[keep])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 9, 16384 * 5 + 3])
def test_threads_and_tails(threads, n):
    g_ = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g_) * 5
    x[-1] = 3.0  # the clip point in the (padded) tail
    g = torch.randn(n, generator=g_)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for op in ACTS:
            y, gx, y_ref, gx_ref = _both(x, g, op)
            _assert_bits(y, y_ref)
            _assert_bits(gx, gx_ref)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("op", sorted(ACTS))
def test_double_backward_is_the_ops_one_by_one(op):
    """create_graph=True: the same first derivative and the same second derivative (Hardswish),
    or the same error (torch has no derivative of hardsigmoid_backward)."""
    x = torch.randn(1003, generator=torch.Generator().manual_seed(5)) * 4
    res = []
    for fused in (True, False):
        a = x.clone().requires_grad_()
        y = island.fused_island(a, op) if fused else _reference(a, op)
        (ga,) = torch.autograd.grad(y.square().sum(), a, create_graph=True)
        try:
            (gga,) = torch.autograd.grad(ga.sum(), a)
        except RuntimeError as e:
            gga = str(e)
        res.append((ga, gga))
    _assert_bits(res[0][0], res[1][0])
    if op == "hardsigmoid":
        assert isinstance(res[0][1], str) and res[0][1] == res[1][1]
    else:
        _assert_bits(res[0][1], res[1][1])


def test_declines_where_the_ops_must_run():
    x = torch.randn(64, 33)
    for bad in (float("nan"), float("inf"), -float("inf"), 65520.0, -1e6):
        y = x.clone()
        y[3, 4] = bad
        assert island.fused_island(y, "hardswish") is None  # NaN / inf after the round trip
    for y in (x.t(), x.double(), torch.empty(0)):
        assert island.fused_island(y, "hardswish") is None
    for off in (island.use_fused, fp_cast.use_kernel):
        previous = off(False)
        try:
            assert island.fused_island(x, "hardswish") is None
        finally:
            off(previous)
    seen = []

    def traced(t):
        seen.append(island.fused_island(t, "hardswish"))
        return t * 2

    torch.jit.trace(traced, (x,), check_trace=False)
    assert seen == [None]
    with torch.no_grad():  # no gradient wanted: the plain output, no autograd node
        y = island.fused_island(x.clone().requires_grad_(), "hardsigmoid")
    assert y is not None and y.grad_fn is None
    _assert_bits(y, _reference(x, "hardsigmoid"))


def _island_modules():
    mods = [fp16_island.island_module(nn.Hardswish(inplace=True), "hs", "activation"),
            fp16_island.island_module(nn.Hardsigmoid(), "hsig", "activation"),
            fp16_island.Fp16Function(F.hardswish, "fhs", "activation"),
            fp16_island.Fp16Function(F.hardsigmoid, "fhsig", "activation")]
    for m in mods:
        for q in m.quantizers().values():
            q.set_state("quantize")
    return mods


def _count_fused(monkeypatch):
    """The ops of the island calls that took the fused path (fused_island returned a tensor)."""
    calls, real = [], fp16_island.fused_island

    def counted(x, op):
        y = real(x, op)
        if y is not None:
            calls.append(op)
        return y
    monkeypatch.setattr(fp16_island, "fused_island", counted)
    return calls


def _module_run(m, x, fused):
    previous = island.use_fused(fused)
    try:
        a = x.clone().requires_grad_()
        y = m(a)
        y.backward(torch.linspace(-2, 2, y.numel()).reshape(y.shape))
        return y, a.grad, a
    finally:
        island.use_fused(previous)


def test_island_modules_take_the_fused_path_with_the_same_bits(monkeypatch):
    calls = _count_fused(monkeypatch)
    x = torch.randn(2, 8, 5, 7) * 4
    x[0, 0, 0, :3] = torch.tensor([-3.0, 3.0, -0.0])
    for m in _island_modules():
        y, gx, a = _module_run(m, x, True)
        y_ref, gx_ref, a_ref = _module_run(m, x, False)
        _assert_bits(y, y_ref)
        _assert_bits(gx, gx_ref)
        _assert_bits(a, x)  # inplace=True: the caller's tensor is not written, as before
    assert calls == ["hardswish", "hardsigmoid", "hardswish", "hardsigmoid"]


def test_a_hook_a_nan_or_a_quantizer_off_runs_the_ops_one_by_one():
    hs = _island_modules()[0]
    x = torch.randn(3, 4, 6)
    seen = []
    handle = hs.input_quant.register_forward_hook(lambda mod, i, o: seen.append(1))
    _module_run(hs, x, True)
    handle.remove()
    assert seen == [1]  # the hook saw its quantizer's call
    x[0, 0, 0] = float("nan")
    y, gx, _ = _module_run(hs, x, True)
    y_ref, gx_ref, _ = _module_run(hs, x, False)
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.equal(torch.isnan(gx), torch.isnan(gx_ref))
    hs.output_quant.set_state("off")  # the output not rounded: F.hardswish of the rounded input
    y, _, _ = _module_run(hs, x.nan_to_num(0.0), True)
    _assert_bits(y, F.hardswish(fake_quantize(x.nan_to_num(0.0), "fp16")))


def _step(model, x, opt):
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = out.square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return loss.detach(), out.detach(), grads


def test_mobilenet_v3_step_is_the_same_with_the_fused_islands_on_and_off(monkeypatch):
    """torchvision's mobilenet_v3_small (random weights) on the a2000: its Hardswish and
    Hardsigmoid are FP16 islands. Two SGD steps with the fused path and two with the ops one by
    one, from the same state: losses, outputs, every gradient and the whole state_dict equal."""
    import torchvision
    calls = _count_fused(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    qat = dal.prepare_qat(torchvision.models.mobilenet_v3_small(weights=None), recipe="int8_balanced",
                          hardware="a2000", example_inputs=(x,))
    dal.calibrate(qat, [x], progress=False)
    runs = []
    for fused in (True, False):
        m = copy.deepcopy(qat).train()
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        previous = island.use_fused(fused)
        try:
            steps = [_step(m, x, opt) for _ in range(2)]
        finally:
            island.use_fused(previous)
        runs.append((steps, m.state_dict()))
    assert calls.count("hardswish") > 0 and calls.count("hardsigmoid") > 0, calls
    (steps_on, sd_on), (steps_off, sd_off) = runs
    for (loss_a, out_a, g_a), (loss_b, out_b, g_b) in zip(steps_on, steps_off):
        _assert_bits(loss_a, loss_b)
        _assert_bits(out_a, out_b)
        assert g_a.keys() == g_b.keys()
        for k in g_a:
            _assert_bits(g_a[k], g_b[k])
    assert sd_on.keys() == sd_off.keys()
    for k in sd_on:
        assert torch.equal(sd_on[k], sd_off[k]), k
