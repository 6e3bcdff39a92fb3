"""torch.compile of a prepared model's training step: no graph break inside dal, and the compiled
step's numbers are the eager step's bit for bit (torch.equal: outputs, loss, every gradient, the
observers' buffers, scales and zero points), quantizers observing ("quantize"), frozen or observing
only ("observe"). Compiles are slow: one small model, few cases.

The eager reference is the quantizers' torch path (``use_kernel(False)``). Against the default
eager path (the C++ kernels of dal.formats) everything is equal too except BatchNorm's gamma
gradients of folded layers: the eager C++ fold accumulates d/d f in float64 (dal.formats.fold), the
compiled step in float32 torch reductions; gamma's gradient is a difference of two such sums, so
they differ by up to a few hundred float32 ulps (measured here: 1 to 176) on most channels.

backend="aot_eager" runs the traced graphs op by op, so it isolates what tracing does. Under
"inductor" the float layers (BatchNorm, the loss) are inductor's own C++ with another summation
order, so a whole step is not the eager one bit for bit; test_inductor_quantizer_step compiles
the quantizers alone with inductor and gets the eager bits.
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

import dal
from dal.quantizer import quantizers
from dal_examples.zoo import MnistCNN

DAL_DIR = os.path.dirname(dal.__file__)


def _prepared(state: str):
    torch.manual_seed(0)
    model = MnistCNN(width=4)
    x = torch.randn(4, 1, 28, 28)
    model = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [torch.randn(4, 1, 28, 28) for _ in range(2)], progress=False)
    for _, q in quantizers(model):
        q.set_state(state)
    return model.train()


def _step(model, x, y):
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return out.detach(), loss.detach()


def _dal_breaks(explained) -> list[str]:
    """The graph breaks whose user stack passes through a file of dal."""
    found = []
    for r in explained.break_reasons:
        frames = [f"{f.filename}:{f.lineno}" for f in r.user_stack if f.filename.startswith(DAL_DIR)]
        if frames:
            found.append(f"{frames[-1]}: {r.reason.splitlines()[0]}")
    return found


@pytest.mark.parametrize("state", ["quantize", "frozen", "observe"])
def test_no_graph_break_inside_dal(state):
    model = _prepared(state)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(4, 1, 28, 28))
    assert _dal_breaks(explained) == []


def _assert_same_step(eager, compiled, x, y, tag, skip_grads=()):
    o1, l1 = _step(eager, x, y)
    o2, l2 = compiled(x, y)
    assert torch.equal(o1, o2) and torch.equal(l1, l2), f"{tag}: outputs differ"
    grads = [n for (n, p), (_, q) in zip(eager.named_parameters(), compiled.model.named_parameters())
             if n not in skip_grads and ((p.grad is None) != (q.grad is None)
                                         or (p.grad is not None and not torch.equal(p.grad, q.grad)))]
    assert grads == [], f"{tag}: gradients differ"
    bufs = [n for (n, b), (_, c) in zip(eager.named_buffers(), compiled.model.named_buffers()) if not torch.equal(b, c)]
    assert bufs == [], f"{tag}: buffers differ (observer ranges, scales, zero points, BN statistics)"


class _Eager:
    def __init__(self, model):
        self.model = model

    def __call__(self, x, y):
        return _step(self.model, x, y)


class _Compiled:
    def __init__(self, model, backend):
        self.model = model
        self.fn = torch.compile(_step, backend=backend)

    def __call__(self, x, y):
        return self.fn(self.model, x, y)


@pytest.mark.parametrize("state", ["quantize", "frozen", "observe", "quantize+frozen_bn"])
def test_compiled_step_is_the_eager_step(state):
    torch._dynamo.reset()
    model = _prepared(state.split("+")[0])
    if state.endswith("frozen_bn"):
        for m in model.modules():
            if hasattr(m, "freeze_bn"):
                m.freeze_bn()
        model.train()
    eager, default, compiled = copy.deepcopy(model), copy.deepcopy(model), _Compiled(copy.deepcopy(model), "aot_eager")
    for _, q in quantizers(eager):
        q.use_kernel(False)
    gammas = {n for n, _ in model.named_parameters() if n.endswith("bn.weight")}
    y = torch.tensor([3, 1, 4, 1])
    for i in range(2):  # the second step reads the buffers the first one wrote
        x = torch.randn(4, 1, 28, 28) * (1 + i)
        for m in (eager, default, compiled.model):
            m.zero_grad(set_to_none=True)
        eager_before = copy.deepcopy(eager)
        _assert_same_step(eager, compiled, x, y, f"{state} step {i}")
        # and the torch path is the default (C++) eager step's, gammas aside (module doc): so is the compiled step
        _assert_same_step(default, _Eager(copy.deepcopy(eager_before)), x, y, f"{state} step {i} (C++ eager)",
                          skip_grads=gammas)


class _QuantizersOnly(torch.nn.Module):
    """An activation quantizer (per tensor, affine uint8) and a weight quantizer (per channel, int8)
    around elementwise float ops, whose results are correctly rounded under any compiler."""

    def __init__(self, act, wq, weight):
        super().__init__()
        self.act, self.wq, self.weight = act, wq, torch.nn.Parameter(weight)

    def forward(self, x):
        return self.act(x) * self.wq(self.weight)


def _quantizers_step(m, x, t):
    y = m(x)
    (y * t).sum().backward()
    return y.detach()


@pytest.mark.parametrize("weight", ["int8_per_channel", "int4_per_group"])
def test_inductor_quantizer_step(weight):
    """Both quantizers observing (QAT), three steps: outputs, input and weight gradients, observer
    ranges, scales and zero points of inductor's compiled step equal the eager step's; the weight
    per channel, or in int4 groups of 8 along its last axis (an LLM weight's groups: the C++ step
    of dal::observe_fake_quantize_ compiled, the torch path eagerly)."""
    from dal.formats import per_channel, per_group
    from dal.quantizer import FakeQuantizer
    torch._dynamo.reset()
    torch.manual_seed(1)
    act = FakeQuantizer("uint8", symmetric=False, observer="moving_average")
    wq = FakeQuantizer("int8", per_channel(0)) if weight == "int8_per_channel" else FakeQuantizer("int4", per_group(1, 8))
    mod = _QuantizersOnly(act, wq, torch.randn(8, 16))
    mod(torch.randn(8, 16) * 3)
    for q in (act, wq):
        q.end_observation("quantize")
    eager, compiled = copy.deepcopy(mod).train(), copy.deepcopy(mod).train()
    for q in (eager.act, eager.wq):
        q.use_kernel(False)
    step = torch.compile(_quantizers_step, backend="inductor")
    for i in range(3):
        x = (torch.randn(8, 16) * (2 + i)).requires_grad_()
        t = torch.randn(8, 16)
        x2 = x.detach().clone().requires_grad_()
        y1, y2 = _quantizers_step(eager, x, t), step(compiled, x2, t)
        assert torch.equal(y1, y2)
        assert torch.equal(x.grad, x2.grad) and torch.equal(eager.weight.grad, compiled.weight.grad)
        for (n, b), (_, c) in zip(eager.named_buffers(), compiled.named_buffers()):
            assert torch.equal(b, c), n


def test_lsq_model_compiles_and_is_the_eager_step():
    """w4a8_lsq (every conv / linear scale learnable, LSQ / LSQ+ by dal::fake_quantize_lsq under
    compile): no graph break inside dal; two aot_eager training steps with an SGD update of every
    parameter (scales and zero points included) in between equal the eager steps (the eager LSQ
    path, dal::fake_quantize_lsq called eagerly, quantizers projecting their Parameters in
    place) bit for bit: outputs, loss, every gradient (scales' and zero points' included), buffers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(4, 1, 28, 28)
    model = dal.prepare_qat(MnistCNN(width=4), recipe="w4a8_lsq", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [torch.randn(4, 1, 28, 28) for _ in range(2)], progress=False)
    model.train()
    learnable = [n for n, q in quantizers(model) if q.learnable]
    assert len(learnable) >= 8 and all(q.state == "quantize" for _, q in quantizers(model))
    assert _dal_breaks(torch._dynamo.explain(model)(x)) == []
    eager, compiled = copy.deepcopy(model), _Compiled(copy.deepcopy(model), "aot_eager")
    for _, q in quantizers(eager):
        q.use_kernel(False)
    y = torch.tensor([3, 1, 4, 1])
    for i in range(2):
        x = torch.randn(4, 1, 28, 28) * (1 + i)
        for m in (eager, compiled.model):
            m.zero_grad(set_to_none=True)
        _assert_same_step(eager, compiled, x, y, f"w4a8_lsq step {i}")
        scale_grads = [p.grad for n, p in eager.named_parameters()
                       if n.endswith((".scale", ".zero_point")) and p.requires_grad]
        assert len(scale_grads) >= len(learnable) and all(g is not None and g.abs().sum() > 0 for g in scale_grads)
        for m in (eager, compiled.model):
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.01 * p.grad


def test_observing_step_is_one_op_per_quantizer():
    """Under torch.compile each observing quantizer's QAT step is one dal::observe_fake_quantize_
    (dal.quantizer_ops.COMPILED_FORM["observe"] == "fused"): the traced graphs call it once per
    quantizer and neither dal::minmax_qparams nor dal::fake_quantize; the step's bits are the eager
    step's (test_inductor_quantizer_step, test_compiled_step_is_the_eager_step)."""
    from dal.formats import per_channel
    from dal.quantizer import FakeQuantizer
    from dal.quantizer_ops import COMPILED_FORM
    assert COMPILED_FORM["observe"] == "fused"
    torch._dynamo.reset()
    act = FakeQuantizer("uint8", symmetric=False, observer="moving_average")
    wq = FakeQuantizer("int8", per_channel(0))
    mod = _QuantizersOnly(act, wq, torch.randn(8, 16))
    mod(torch.randn(8, 16))
    for q in (act, wq):
        q.end_observation("quantize")
    mod.train()
    called = []

    def backend(gm, example_inputs):
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                called.extend(str(n.target) for n in sub.graph.nodes if n.op == "call_function")
        return gm

    torch.compile(mod, backend=backend, fullgraph=True)(torch.randn(8, 16).requires_grad_()).sum().backward()
    ops = [c for c in called if c.startswith("dal.")]
    assert ops.count("dal.observe_fake_quantize_.default") == 2, ops
    assert not [c for c in ops if "minmax_qparams" in c or "fake_quantize.default" in c], ops


def test_inductor_fp16_island_keeps_the_rounding():
    """An FP16 quantizer (an island's cast) under inductor, with a multiply after it: the output is
    torch's eager ``x.to(float16).to(float32) * 1.5`` bit for bit, for the forward and the identity
    gradient. The round trip stays the opaque ``dal::fp_round_trip`` under torch.compile: inductor
    (``emulate_precision_casts`` off, its default) drops a plain-torch ``x.to(float16).to(float32)``
    inside a fused kernel (bench/results/llm_qat.md, "tried and not kept")."""
    from dal.quantizer import FakeQuantizer
    torch._dynamo.reset()
    q = FakeQuantizer("fp16")
    q.set_state("quantize")
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 3).requires_grad_()
    want = x.detach().to(torch.float16).to(torch.float32) * 1.5
    assert not torch.equal(want, x.detach() * 1.5)  # the rounding is visible
    y = torch.compile(lambda t: q(t) * 1.5, backend="inductor")(x)
    assert torch.equal(y.detach(), want)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 1.5))
