"""``self.training`` in a traced forward is read at run time (dal.nn.own_forward): torch.fx
would freeze the bool it held while tracing, so a model prepared in train mode kept its dropout
in eval (and in its export), and one prepared in eval never dropped out in training."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dal

X = torch.randn(8, 16)


class Head(nn.Module):
    """timm's forward_head: a functional dropout on the module's own flag (the ``+`` makes prepare
    rewrite the forward from its graph)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        x = F.dropout(torch.relu(self.fc1(x)), p=0.5, training=self.training)
        return self.fc2(x) + x[:, :4]


class Branch(nn.Module):
    """A branch on the flag, which fx cannot keep both sides of."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        y = self.fc1(x)
        if self.training:
            y = y * 0.5
        return self.fc2(y) + y[:, :4]


def _prepared(model, mode):
    torch.manual_seed(0)
    getattr(model, mode)()
    q = dal.prepare_qat(model, recipe="int8_balanced", hardware="generic_int8", example_inputs=(X,))
    dal.calibrate(q, [X], progress=False)
    return q


def _drops_out(q) -> bool:
    with torch.no_grad():
        return not torch.equal(q(X), q(X))


@pytest.mark.parametrize("mode", ["train", "eval", "saved", "copied"])
def test_a_functional_dropout_follows_the_mode_it_runs_in(mode, tmp_path):
    q = _prepared(Head(), "train" if mode in ("saved", "copied") else mode)
    if mode == "saved":
        torch.save(q, tmp_path / "q.pt")
        q = torch.load(tmp_path / "q.pt", weights_only=False)
    elif mode == "copied":
        q = copy.deepcopy(q)
    q.train()
    assert _drops_out(q)
    q.eval()
    assert not _drops_out(q)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_branch_on_the_flag_runs_as_written(mode):
    q = _prepared(Branch(), mode)
    ref = Branch()
    ref.load_state_dict({k: v for k, v in q.state_dict().items() if k in ref.state_dict()})
    dal.set_quantizer_state(q, "off")  # the float model's arithmetic: only the branch differs
    for m in ("train", "eval"):
        getattr(q, m)(), getattr(ref, m)()
        with torch.no_grad():
            assert torch.equal(q(X), ref(X)), m


def test_timm_ghostnet_prepared_in_train_mode_evaluates_deterministically():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    q = dal.prepare_qat(timm.create_model("ghostnet_100", pretrained=False, num_classes=10).train(),
                        recipe="int8_balanced", hardware="a2000", example_inputs=(x,))
    dal.calibrate(q, [x], progress=False)
    q.eval()
    with torch.no_grad():
        assert torch.equal(q(x), q(x))
