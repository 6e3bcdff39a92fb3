"""An owner's call-site mode steps off torch's function-mode stack while the modules its forward
calls run (dal.prepare.site_pause): their torch calls (adds and muls among them) never reach the
mode's Python handler, every call site of the owner's own code is still routed to its module, and
no output, gradient or quantizer state changes (against the same model with the pause disabled,
and the site outputs against a float64 fake quantization written here)."""
import copy

import pytest
import torch
from torch import nn

import dal
from dal.prepare import call_sites


class Owner(nn.Module):
    """A projection, then residual blocks (a ModuleList: their elements are called directly), then
    a gate; fx cannot trace the forward (Python control flow on a shape). Records the depth of
    torch's function-mode stack in its own code (``seen``)."""

    def __init__(self, device_context: bool = False):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
        self.device_context = device_context
        self.seen = []

    def forward(self, x):
        self.seen.append(torch._C._len_torch_function_stack())
        if x.shape[-1] >= 8:
            if self.device_context:  # a mode the forward enters itself, above the owner's
                with torch.device("cpu"):
                    y = self.proj(x)
            else:
                y = self.proj(x)
        for blk in self.blocks:
            y = y + blk(y)  # two add sites (one line, two calls)
        self.seen.append(torch._C._len_torch_function_stack())
        return y * x  # a mul site


def _x(seed):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _model(device_context=False):
    torch.manual_seed(0)
    m = dal.prepare_qat(Owner(device_context), recipe="int8_balanced", hardware="a2000", example_inputs=(_x(0),),
                        quantize_outputs=True)
    dal.calibrate(m, [_x(1), _x(2)], progress=False)
    return m


def _steps(m, n=2):
    """``n`` QAT steps (quantizers observing), SGD; the outputs, input grads and the state_dict."""
    m.train()
    dal.set_quantizer_state(m, "quantize")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    outs = []
    for i in range(n):
        x = _x(10 + i).requires_grad_()
        y = m(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append((y.detach(), x.grad))
    return outs, {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def paused_and_not():
    """The same model twice: as prepare_qat makes it, and with ``pause_callees`` a no-op for every
    one of its forwards (calibration, QAT steps), the call-site mode then seeing every call."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(call_sites, "pause_callees", lambda *args: None)
        plain = _model()
        plain_run = _steps(plain)
        plain_seen = list(plain.seen)
    paused = _model()
    return paused, _steps(paused), plain_seen, plain_run


def _stack_depth_in(module):
    depth = []
    h = module.register_forward_pre_hook(lambda mod, args: depth.append(torch._C._len_torch_function_stack()))
    return depth, h


def test_callees_run_with_the_owners_mode_off_the_stack_and_the_sites_are_still_routed(paused_and_not):
    m = copy.deepcopy(paused_and_not[0])
    sites = dict(m.dal_sites.items())
    assert sorted(k.split("_l")[0] for k in sites) == ["add", "add", "mul"]
    called = {k: 0 for k in sites}
    hooks = [mod.register_forward_hook(lambda mod, i, o, k=k: called.__setitem__(k, called[k] + 1))
             for k, mod in sites.items()]
    in_proj, h1 = _stack_depth_in(m.proj.input_quant)        # a quantizer inside a direct child
    in_block, h2 = _stack_depth_in(m.blocks[1][0])            # a ModuleList element's layer
    m.seen.clear()
    m(_x(20))
    for h in [*hooks, h1, h2]:
        h.remove()
    # the owner's own code runs under its mode, before and after its callees; the callees (and
    # the modules inside them) without it: none of their calls reaches the mode's handler
    assert m.seen == [1, 1] and in_proj == [0] and in_block == [0]
    assert called == {k: 1 for k in sites}  # every site of the owner's code still routed, once
    assert torch._C._len_torch_function_stack() == 0


def test_the_pause_changes_no_output_gradient_or_quantizer_state(paused_and_not):
    _, (outs, state), plain_seen, (plain_outs, plain_state) = paused_and_not
    assert plain_seen[-4:] == [1, 1, 1, 1]  # (the QAT steps: the mode on while the owner runs)
    for (y, g), (py, pg) in zip(outs, plain_outs):
        assert torch.equal(y, py) and torch.equal(g, pg)
    assert state.keys() == plain_state.keys()
    assert all(torch.equal(state[k], plain_state[k]) for k in state)


def _fq64(x, q):
    """Fake quantization in float64 from the quantizer's scale and zero point (per tensor):
    ``(clamp(round(x / s) + zp, qmin, qmax) - zp) * s``, round half to even."""
    s, zp = q.scale.double(), q.zero_point.double()
    return (torch.clamp(torch.round(x.double() / s) + zp, q.qmin, q.qmax) - zp) * s


def test_each_site_output_is_the_float64_fake_quantized_op(paused_and_not):
    m = copy.deepcopy(paused_and_not[0]).eval()
    dal.set_quantizer_state(m, "frozen")
    got = {}
    hooks = [mod.register_forward_hook(lambda mod, i, o, k=k: got.__setitem__(k, (i, o)))
             for k, mod in m.dal_sites.items()]
    with torch.no_grad():
        m(_x(21))
    for h in hooks:
        h.remove()
    assert len(got) == 3
    for key, ((a, b), out) in got.items():
        site = m.dal_sites[key]
        qa, qb = (_fq64(t, q).float().double() for t, q in zip((a, b), site.input_quants))  # as stored
        add = key.startswith("add")
        value = qa + qb if add else qa * qb
        sa, sb = (float(q.scale) for q in site.input_quants)
        # what one input code off (a tie x / s decided otherwise in float32) moves the value by
        slack = sa + sb if add else sa * qb.abs() + sb * qa.abs() + sa * sb
        if site.output_quant is not None:
            lsb = float(site.output_quant.scale)
            codes = out.double() / lsb
            torch.testing.assert_close(codes, torch.round(codes), rtol=0, atol=1e-4)  # on the output grid
            value, slack = _fq64(value, site.output_quant), slack + lsb
        diff = (out.double() - value.float().double()).abs()  # float32 values: the exact result rounded once
        assert (diff == 0).double().mean() >= 0.99 and bool((diff <= slack).all()), key


def test_a_mode_the_forward_entered_itself_stays_on_top_and_the_pause_is_skipped():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(call_sites, "pause_callees", lambda *args: None)
        plain = _model(device_context=True)
        plain.eval()
        with torch.no_grad():
            expect = plain(_x(30))
    m = _model(device_context=True).eval()
    depth, h = _stack_depth_in(m.proj.input_quant)
    with torch.no_grad():
        y = m(_x(30))
    h.remove()
    # the probe saw torch.device's mode above the owner's: nothing taken off (device + owner modes)
    assert depth == [2] and torch.equal(y, expect)
    assert torch._C._len_torch_function_stack() == 0


class Gate(nn.Module):
    """fx traces it: prepare rewrites its ``*`` into a QMul, the module into a GraphModule."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * torch.sigmoid(x)


class Nest(nn.Module):
    """An untraceable forward holding an instance of its own class: the inner one runs the outer's
    forward code, so its calls are the outer's sites too (call_sites' frame rule)."""

    def __init__(self, inner: bool = True):
        super().__init__()
        self.gate = Gate()
        self.inner = Nest(False) if inner else None

    def forward(self, x):
        if x.shape[-1] >= 8:
            y = self.gate(x)
        if self.inner is not None:
            y = y + self.inner(y)
        return y + x


def _nest():
    torch.manual_seed(0)
    m = dal.prepare_qat(Nest(), recipe="int8_balanced", hardware="a2000", example_inputs=(_x(0),))
    dal.calibrate(m, [_x(1), _x(2)], progress=False)
    return m.eval()


def test_a_deep_copied_graphmodule_callee_gets_its_hooks_back_and_a_nested_owner_is_left_alone():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(call_sites, "pause_callees", lambda *args: None)
        plain = _nest()
        with torch.no_grad():
            expect = plain(_x(40))
    m = copy.deepcopy(_nest())  # GraphModule's deepcopy drops forward hooks, keeps attributes
    assert isinstance(m.gate, torch.fx.GraphModule)
    in_gate, h1 = _stack_depth_in(m.gate.lin)
    in_inner, h2 = _stack_depth_in(m.inner.gate.lin)
    with torch.no_grad():
        y = m(_x(40))
    h1.remove(), h2.remove()
    assert torch.equal(y, expect)
    assert in_gate == [0]  # hooked again at the owner's forward: the mode off while the gate runs
    # the inner Nest runs the outer's forward code: left alone, the outer's mode stays under the
    # inner's (which steps off for the inner's own gate)
    assert m.dal_site_alone == [m.inner] and in_inner == [1]
    assert torch._C._len_torch_function_stack() == 0


def test_a_callee_holding_a_module_whose_fused_path_reads_the_mode_is_left_alone():
    from dal.prepare import site_pause

    owner = nn.Module()
    owner.proj = nn.Linear(8, 8)
    owner.attn = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True))
    owner.encoder = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    site_pause.pause_callees(owner, call_sites._body_codes, call_sites.SITES_ATTR, "dal_site_modes")
    # torch takes MHA's / the encoder layer's native kernel only where has_torch_function is false:
    # taking the owner's mode off would change their numbers in eval
    assert owner.dal_site_alone == [owner.attn, owner.encoder]
    before = len(owner.proj._forward_pre_hooks)
    site_pause.pause_callees(owner, call_sites._body_codes, call_sites.SITES_ATTR, "dal_site_modes")
    assert len(owner.proj._forward_pre_hooks) == before == 1  # hooked once
