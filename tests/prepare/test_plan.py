"""prepare as plan -> check -> apply: the report accounts for every module and functional op,
float ops are checked against the hardware model, and dal.prepared sees through wrappers."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal
from dal.recipe.errors import RecipeError


class SeNet(nn.Module):
    """Conv-BN-SiLU, a squeeze-excitation Sigmoid, global average pooling and a classifier: the
    float ops of an EfficientNet block, small."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.SiLU()
        self.gate = nn.Sigmoid()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        y = y * self.gate(y)
        return self.fc(torch.flatten(self.pool(y), 1))


class LoneBn(nn.Module):
    """A BatchNorm that does not follow a conv: nothing can fold it."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(self.bn(x))


def _x(shape=(2, 3, 8, 8)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _rows(model):
    return {r.name: r for r in dal.prepared(model).report.rows}


def test_every_module_and_functional_op_is_in_the_report():
    q = dal.prepare_qat(SeNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(_x(),))
    rows = _rows(q)
    assert rows["conv"].status == "quantized" and "fused with bn" in rows["conv"].detail
    # FP16 islands on the a2000 (its vector engine has compute: fp16): input and output rounded to fp16
    for path, how in (("act", "runs in FP16"), ("gate", "runs in FP16"), ("pool", "averages in fp16")):
        assert rows[path].status == "fp16" and "an FP16 island" in rows[path].detail, rows[path]
        assert how in rows[path].detail and rows[path].type_name == f"Fp16{type(getattr(SeNet(), path)).__name__}"
    assert q.act.quantizers()["input_quant"].fmt.name == "fp16" and isinstance(q.pool.to_float(), nn.AdaptiveAvgPool2d)
    assert rows["fc"].status == "quantized"
    assert [r.type_name for r in rows.values() if r.op_class == "mul"] == ["QMul"]
    assert any(r.type_name == "flatten" and r.status == "passthrough" for r in rows.values())
    # every leaf module of the float model is accounted for (bn by the fused conv's row)
    leaves = {n for n, m in SeNet().named_modules() if n and not list(m.children())}
    assert leaves - {"bn"} <= set(rows)
    report = dal.prepared(q).report
    assert str(report).splitlines()[0].endswith(
        f"{len(report.by_status('quantized'))} quantized, 3 fp16, {len(report.by_status('passthrough'))} "
        f"passthrough, 0 left in float")


def test_float_activations_on_int8_only_hardware_are_refused_by_path_with_the_fix():
    with pytest.raises(RecipeError) as err:
        dal.prepare_qat(SeNet(), recipe="int8_balanced", hardware="a1000", example_inputs=(_x(),))
    text = str(err.value)
    assert "act (SiLU)" in text and "gate (Sigmoid)" in text and "lut_activation" in text
    offenders = [line.strip(" -").split(" ")[0] for line in text.splitlines()[1:]]
    assert offenders == ["act", "gate"]  # integer pooling (pool) runs on the a1000: not refused


def test_the_replacement_the_error_names_fixes_it():
    recipe = dal.load_recipe("int8_balanced").to_dict()
    recipe["replace"] = ["lut_activation"]
    q = dal.prepare_qat(SeNet(), recipe=recipe, hardware="a1000", example_inputs=(_x(),))
    rows = _rows(q)
    assert rows["act"].status == "quantized" and rows["gate"].status == "quantized"


def test_a_skip_rule_keeps_an_op_off_the_npu_on_purpose():
    recipe = dal.load_recipe("int8_balanced").to_dict()
    recipe["rules"] = [{"match": ["act", "gate"], "skip": True}] + recipe["rules"]
    q = dal.prepare_qat(SeNet(), recipe=recipe, hardware="a1000", example_inputs=(_x(),))
    assert "kept off the NPU by its recipe rule" in _rows(q)["act"].detail


def test_an_unfoldable_batchnorm_becomes_a_quantized_per_channel_affine():
    import copy

    float_model = LoneBn()
    ref = copy.deepcopy(float_model.bn)  # torch's own BatchNorm2d is the oracle
    q = dal.prepare_qat(float_model, recipe="int8_balanced", hardware="a1000", example_inputs=(_x(),))
    row = _rows(q)["bn"]
    assert row.status == "quantized" and row.type_name == "QBatchNorm2d" and "per-channel affine" in row.detail
    assert "0 left in float" in str(dal.prepared(q).report).splitlines()[0]
    x = _x((4, 3, 8, 8)) * 3 + 1
    with dal.quantizer_states(q, "off"):
        for train in (True, True, False):  # two training steps (running stats move), then eval
            q.train(train), ref.train(train)
            torch.testing.assert_close(q.bn(x), ref(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(q.bn.running_var, ref.running_var, rtol=1e-6, atol=1e-7)
    assert int(q.bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2


def test_a_module_without_a_qat_class_is_listed_with_the_hardwares_verdict():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 4, batch_first=True)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    q = dal.prepare_qat(Seq(), recipe="int8_balanced", hardware="a2000", example_inputs=(torch.randn(2, 3, 4),))
    row = _rows(q)["rnn"]
    assert row.status == "float" and "register_qat_module(LSTM)" in row.detail and "cannot run" in row.detail
    with pytest.raises(ValueError, match=r"strict=True.*\n.*rnn: LSTM"):
        dal.prepare_qat(Seq(), recipe="int8_balanced", hardware="a2000", strict=True)


def test_prepared_sees_through_wrappers():
    q = dal.prepare_qat(SeNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(_x(),))
    handle = dal.prepared(q)
    assert handle.recipe.name == "int8_balanced" and handle.hardware.name == "a2000"
    assert dal.prepared(torch.compile(q)) is handle
    assert dal.prepared(nn.DataParallel(q)) is handle

    class Holder(nn.Module):  # a LightningModule holds its network as an attribute in the same way
        def __init__(self):
            super().__init__()
            self.loss = nn.CrossEntropyLoss()
            self.model = q

    assert dal.prepared(Holder()) is handle
    with pytest.raises(ValueError, match="was never prepared by dal: call dal.prepare_qat"):
        dal.prepared(SeNet())


def test_prepared_sees_through_ddp(tmp_path):
    import torch.distributed as dist

    # a file rendezvous: no TCP port to clash with another test process
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        q = dal.prepare_qat(SeNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(_x(),))
        dal.calibrate(q, [_x()], progress=False)
        wrapped = nn.parallel.DistributedDataParallel(q)
        assert dal.prepared(wrapped).recipe == dal.prepared(q).recipe
        dal.calibrate(wrapped, [_x()], progress=False)  # the recipe's calibration section is found through DDP
    finally:
        dist.destroy_process_group()


def test_prepare_traces_each_forward_once(monkeypatch):
    import dal.prepare.plan as plan

    calls = []
    real = plan.trace_own_forward
    monkeypatch.setattr(plan, "trace_own_forward", lambda m: calls.append(type(m).__name__) or real(m))
    dal.prepare_qat(SeNet(), recipe="int8_balanced", hardware="a2000", example_inputs=(_x(),))
    assert calls == ["SeNet"]


def test_functional_float_ops_in_a_traced_forward_are_checked_too():
    class Fn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return F.silu(self.conv(x))

    with pytest.raises(RecipeError, match=r"silu \(silu\).*lut_activation"):
        dal.prepare_qat(Fn(), recipe="int8_balanced", hardware="a1000", example_inputs=(_x(),))


def test_an_island_function_called_with_its_tensor_as_keyword():
    """torch.sigmoid(input=y) in a traced forward on the a2000 (fp16 vector engine) becomes an FP16
    island like the positional call; with quantizers off it computes torch's own sigmoid."""
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.head = nn.Conv2d(4, 2, 1)

        def forward(self, x):
            y = self.conv(x)
            return self.head(y * torch.sigmoid(input=y))

    float_model = Gate()
    ref = copy.deepcopy(float_model)
    q = dal.prepare_qat(float_model, recipe="int8_balanced", hardware="a2000", example_inputs=(_x(),))
    islands = [m for m in q.modules() if type(m).__name__ == "Fp16Function"]
    assert len(islands) == 1 and islands[0].fn is torch.sigmoid
    x = _x((2, 3, 8, 8))
    with dal.quantizer_states(q, "off"):
        assert torch.equal(q(x), ref(x))


class _OptionalShortcut(nn.Module):
    """timm's DLA block: ``forward(x, shortcut=None)`` with ``if shortcut is None: shortcut = x``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, shortcut=None):
        if shortcut is None:
            shortcut = x
        return self.conv(x) + shortcut


def test_a_forward_that_tests_an_argument_against_none_is_not_fx_traced():
    """torch.fx would trace the branch of "shortcut given" and the prepared block would then add
    None when called with the default; the forward is left to the call-site capture instead,
    which still quantizes its ``+`` (listed by call site)."""
    net = nn.Sequential(_OptionalShortcut(), _OptionalShortcut()).eval()
    x = torch.randn(1, 4, 6, 6)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    dal.prepare.set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x))
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    assert any(r.op_class == "add" and r.status == "quantized" for r in rows.values()), rows
    notes = dal.prepared(q).report.notes
    assert sum("forward tests shortcut against None" in n for n in notes) == 2, notes


def _warm_bn(net: nn.Module) -> nn.Module:
    """Running statistics away from (0, 1), so that a BN applied twice or not at all shows."""
    torch.manual_seed(0)
    for b in net.modules():
        if isinstance(b, nn.BatchNorm2d):
            b.running_mean.uniform_(-1, 1)
            b.running_var.uniform_(0.5, 2)
    return net.eval()


class _DirectForward(nn.Module):
    """timm's HRNet head: ``down.forward(y)`` on a Sequential(conv, bn, relu), not ``down(y)``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.down = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        return self.down.forward(self.conv(x))


def test_a_submodule_forward_called_directly_is_one_leaf_call():
    """fx sees only ``__call__``: it traced through ``down.forward`` and put the Sequential's conv,
    bn and relu in the parent's graph too, so the fusion was planned twice and the second one
    failed ("Sequential has no attribute `1`", hrnet_w18_small). The direct call is now a leaf
    call of ``down``: one fusion, in the Sequential, and the function of the float model."""
    net = _warm_bn(_DirectForward())
    x = torch.randn(2, 3, 8, 8)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    fused = [r for r in dal.prepared(q).report.rows if r.type_name == "QConvBnReLU2d"]
    assert [r.name for r in fused] == ["down.0"], dal.prepared(q).report.rows
    assert "forward" not in net.down.__dict__  # the tracing patch is undone
    dal.prepare.set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x), rtol=1e-4, atol=1e-4)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


class _ReachesIn(nn.Module):
    """The parent calls the block's conv itself as well as the block."""

    def __init__(self):
        super().__init__()
        self.inner = _Inner()

    def forward(self, x):
        return self.inner.conv(x) + self.inner(x)


def test_a_conv_that_another_forward_also_calls_is_not_folded():
    """Folding ``inner.bn`` into ``inner.conv`` (planned from the block's graph) silently added the
    BN to the parent's own call of the conv (every output differed). A conv or BN called from more
    than one captured forward is left unfolded: the BN is a quantized affine of its own."""
    net = _warm_bn(_ReachesIn())
    x = torch.randn(2, 4, 8, 8)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    rows = {r.name: r for r in dal.prepared(q).report.rows}
    assert rows["inner.conv"].type_name == "QConv2d" and rows["inner.bn"].type_name == "QBatchNorm2d", rows
    dal.prepare.set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x), rtol=1e-4, atol=1e-4)


class _ListBlock(nn.Module):
    """timm's SelecSLS block: takes a tensor or a list, ``if not isinstance(x, list): x = [x]``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        if not isinstance(x, list):
            x = [x]
        y = self.conv(x[0])
        return [y, y + x[-1]]


class _ListChain(nn.Sequential):
    def forward(self, x):
        for block in self:
            x = block(x)
        return x[1]


def test_a_forward_that_tests_its_argument_type_is_not_fx_traced():
    """fx passes a Proxy, which is not a list: the traced block wrapped its input in a list, and
    the second block (given a real list) fed the list to its conv (TypeError, selecsls42b). Such a
    forward goes to the call-site capture, which runs it as written and still quantizes its ``+``."""
    net = _ListChain(_ListBlock(), _ListBlock()).eval()
    x = torch.randn(2, 4, 8, 8)
    q = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(x,), inplace=False)
    rows = dal.prepared(q).report.rows
    assert sum(r.op_class == "add" and r.status == "quantized" for r in rows) == 2, rows
    notes = dal.prepared(q).report.notes
    assert sum("forward tests the type of x" in n for n in notes) == 2, notes
    dal.prepare.set_quantizer_state(q, "off")
    with torch.no_grad():
        torch.testing.assert_close(q(x), net(x))
