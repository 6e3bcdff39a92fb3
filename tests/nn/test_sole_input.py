"""dal.nn.sole_input: an input quantizer writes in place only where it is its input's only reader.

Each case trains the same steps on a prepared model and on a deep copy whose Sequentials run
torch's own loop (no offers, every quantizer writes a new tensor), and compares outputs, every
gradient and every buffer bit for bit. The out-of-place route is itself checked against torch's
ops and float64 oracles elsewhere (tests/test_quantizer_fast_path.py, tests/formats). Then each
refusal: a tensor someone else still holds must come out of the step unchanged.
"""
import copy
import io

import pytest
import torch
import torchvision
from torch import nn

import dal
import dal.quantizer_sole_input as sole_input
from dal.formats import native
from dal.formats import track_call
from dal.nn import masked_activation
from dal.nn import sole_input as loops

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no fused kernel: {native.status()}")


@pytest.fixture(autouse=True)
def small_tensors_too(monkeypatch):
    """These nets are small: in-place ReLU modules take the bit-mask node below its size bound too."""
    monkeypatch.setattr(masked_activation, "MIN_ELEMENTS", 0)


@pytest.fixture
def takes(monkeypatch):
    """How many quantizer calls wrote in place."""
    count = [0]
    real = track_call.TrackCall.in_place

    def counted(self, x):
        y = real(self, x)
        count[0] += y is not None
        return y
    monkeypatch.setattr(track_call.TrackCall, "in_place", counted)
    return count


def _torch_loops(model):
    """The same model with no offers: torch's Sequential loop everywhere, no offer_output node."""
    for m in model.modules():
        m.__dict__.pop("forward", None)
        if isinstance(m, torch.fx.GraphModule):
            for node in list(m.graph.nodes):
                if node.op == "call_function" and node.target is loops.offer_output:
                    node.replace_all_uses_with(node.args[0])
                    m.graph.erase_node(node)
            m.graph.eliminate_dead_code()
            m.recompile()
    return model


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8) if t.is_floating_point() else t


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what


def _prepared(model, x):
    model = dal.prepare_qat(model.train(), recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(model, [x], num_batches=1, progress=False)
    return model.train()


def _train_both(fast, slow, steps=3, shape=(2, 3, 64, 64)):
    gen = torch.Generator().manual_seed(11)
    for i in range(steps):
        x = torch.randn(shape, generator=gen)
        outs = []
        for model in (fast, slow):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(100 + i)  # the same dropout masks
            y = model(x)
            y.backward(torch.ones_like(y) / y.numel())
            outs.append(y.detach())
        _same(outs[0], outs[1], f"step {i}: output")
        for (name, p), q in zip(fast.named_parameters(), slow.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {i}: grad of {name}"
            if p.grad is not None:
                _same(p.grad, q.grad, f"step {i}: grad {name}")
        for (name, b), c in zip(fast.state_dict().items(), slow.state_dict().values()):
            _same(b, c, f"step {i}: buffer {name}")
        with torch.no_grad():
            for p, q in zip(fast.parameters(), slow.parameters()):
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)


@pytest.mark.parametrize("arch,per_step", [("mobilenet_v3_small", 10), ("mobilenet_v2", 30)])
def test_a_mobilenet_trains_to_the_same_bits_with_fewer_tensors(takes, arch, per_step):
    """torchvision's MobileNetV3 (fx-traced blocks, Sequentials, SE, ReLU and Hardswish) and
    MobileNetV2 (ReLU6 after every expand and depthwise conv): the expand -> depthwise ->
    projection edges are written in place, the residual inputs are not."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    fast = _prepared(getattr(torchvision.models, arch)(num_classes=10), x)
    slow = _torch_loops(copy.deepcopy(fast))
    _train_both(fast, slow)
    assert takes[0] >= 3 * per_step, takes[0]


def _cbn(cin, cout, act=None):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), *([act] if act else []))


def _chain(relu_in_place=True):
    """A Sequential that prepare keeps (its children fold into traced Conv + BN layers). Edges:
    0 -> ReLU -> 2, 2 -> 3, 3 -> 4, 4 -> 5 (each a QAT layer's output, or an in-place ReLU's,
    which trains by the bit-mask node (dal.nn.masked_activation), into the next one's input
    quantizer: offered). With ``relu_in_place=False`` the ReLU returns a new tensor (torch.relu
    keeps its result: 1 -> 2 not offered)."""
    torch.manual_seed(1)
    return nn.Sequential(_cbn(3, 8), nn.ReLU(inplace=relu_in_place), _cbn(8, 8, nn.ReLU()),
                         _cbn(8, 8, nn.Hardswish()), _cbn(8, 4), nn.Conv2d(4, 4, 1))


X = (2, 3, 16, 16)


def _offers(model):
    """The tensors the loops offered in one training step, by the autograd node that made them."""
    seen = []
    real = sole_input.offer

    def counted(q, t):
        seen.append(type(t.grad_fn).__name__)
        real(q, t)
    sole_input.offer = counted
    try:
        model(torch.randn(X)).sum().backward()
    finally:
        sole_input.offer = real
    return seen


@pytest.mark.parametrize("relu_in_place", [True, False])
def test_a_chain_is_written_in_place_except_after_torch_relu(takes, relu_in_place):
    fast = _prepared(_chain(relu_in_place), torch.randn(X))
    offered = ["ReluMaskFunctionBackward", "_IslandFunctionBackward", "NativeBatchNormBackward0"]
    assert sorted(_offers(fast)) == sorted(offered + ["ReluMaskFunctionBackward"] * relu_in_place)
    takes[0] = 0
    slow = _torch_loops(copy.deepcopy(fast))  # torch's loops and torch's ReLU modules
    _train_both(fast, slow, shape=X)
    assert takes[0] == 3 * (3 + relu_in_place)


@pytest.mark.parametrize("keep", ["tensor", "view", "detach"])
def test_a_tensor_someone_keeps_is_not_overwritten(keep):
    """A forward hook keeps child 2's output, a view of it, or its ``detach()`` (the same memory,
    no Python reference to it: the storage's use count shows it): the next quantizer writes a
    new tensor, and what was kept still holds the float values it had."""
    fast = _prepared(_chain(), torch.randn(X))
    kept = []

    def keep_output(module, inputs, out):
        t = {"tensor": out, "view": out[:, :3], "detach": out.detach()}[keep]
        kept.append((t, t.detach().clone()))
    fast[2].register_forward_hook(keep_output)
    slow = _torch_loops(copy.deepcopy(fast))
    _train_both(fast, slow, shape=X)
    assert len(_offers(fast)) == 3  # 1 -> 2, 3 -> 4 and 4 -> 5 still
    assert kept and all(torch.equal(t.detach(), then) for t, then in kept)


def test_a_pre_hook_on_the_reader_or_a_hook_on_its_quantizer_stops_the_offer():
    for where in ("reader", "quantizer"):
        model = _prepared(_chain(), torch.randn(X))
        assert len(_offers(model)) == 4
        reader = next(m for m in model[3].modules() if hasattr(m, "input_quant"))
        target = reader if where == "reader" else reader.input_quant
        target.register_forward_pre_hook(lambda m, i: None)
        assert len(_offers(model)) == 3, where


def test_a_graph_input_with_two_uses_is_not_offered():
    """A residual block: its input feeds the conv and the add."""

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x):
            return self.bn(self.conv(x)) + x

    class Single(Residual):
        def forward(self, x):
            return self.bn(self.conv(x))

    torch.manual_seed(2)
    model = _prepared(nn.Sequential(_cbn(3, 8), Residual(), Single(), nn.Conv2d(8, 4, 1)), torch.randn(X))
    assert all(isinstance(model[i], torch.fx.GraphModule) for i in (1, 2))
    assert loops._first_input_quant(model[1]) is None
    assert loops._first_input_quant(model[2]) is not None
    slow = _torch_loops(copy.deepcopy(model))
    _train_both(model, slow, shape=X)


def _offer_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is loops.offer_output]


def test_a_traced_chain_offers_between_its_graph_nodes(takes):
    """A root that prepare traces into a GraphModule: its generated forward calls the layers
    directly, so offer_output nodes sit on the single-use edges between them: into c2, into
    the add (the residual branch's output) and into the head; not on c0's output, which c1
    and the add both read."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c0, self.b0 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            x = torch.relu(self.b0(self.c0(x)))
            y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
            return self.head(y + x)

    torch.manual_seed(3)
    fast = _prepared(Net(), torch.randn(X))
    assert isinstance(fast, torch.fx.GraphModule)
    readers = sorted(str(n.args[1].target) for n in _offer_nodes(fast))
    assert readers == sorted(["c2", "add", "head"]), fast.code  # c0's output feeds c1 and the add: not offered
    slow = _torch_loops(copy.deepcopy(fast))
    assert not _offer_nodes(slow)
    takes[0] = 0
    _train_both(fast, slow, shape=X)
    assert takes[0] == 2 * 3  # the first step binds the quantizers (dal.quantizer_bound), two write in place
    kept = []
    fast.get_submodule("c1").register_forward_hook(lambda m, i, o: kept.append((o, o.detach().clone())))
    fast(torch.randn(X)).sum().backward()
    assert takes[0] == 2 * 3 + 2 and torch.equal(kept[0][0].detach(), kept[0][1])


def test_eval_no_grad_and_copies():
    x = torch.randn(X)
    model = _prepared(_chain(), x)
    model.eval()
    with torch.no_grad():
        assert _offered_eval(model, x) == 0
    model.train()
    twin = copy.deepcopy(model)
    seqs = [m for m in twin.modules() if isinstance(m, nn.Sequential) and "forward" in m.__dict__]
    assert seqs and all(m.forward.seq is m for m in seqs), "a deep copy runs its own children"
    relus = [m for m in twin.modules() if type(m) is nn.ReLU and m.inplace]
    assert relus and all(m.forward.module is m for m in relus)
    plain = _prepared(nn.Sequential(_cbn(3, 8, nn.ReLU()), _cbn(8, 4)), x)  # no FP16 island: it pickles
    buf = io.BytesIO()
    torch.save(plain, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded.forward, loops.SoleInputLoop) and loaded.forward.seq is loaded
    _same(loaded.eval()(x), plain.eval()(x), "a pickled model loads and computes the same")


def _offered_eval(model, x):
    count = [0]
    real = sole_input.offer
    sole_input.offer = lambda q, t: count.__setitem__(0, count[0] + 1)
    try:
        model(x)
    finally:
        sole_input.offer = real
    return count[0]
