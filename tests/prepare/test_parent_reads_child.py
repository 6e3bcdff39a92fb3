"""A parent's forward reads attributes of a child that prepare replaced.

* A child whose forward prepare rewrote (a GraphModule now) keeps its own plain attributes:
  torchvision RAFT reads ``self.update_block.hidden_state_size`` (it used to be an AttributeError).
* A module shared under two names (timm CoaT's ``cpe1`` is also ``serial_blocks1.0.cpe``) is
  swapped in every slot: the GraphModule of the root keeps only the names its graph calls, so the
  plan's name ``cpe1`` was gone ("CoaT has no attribute `cpe1`"), and a module under two names
  would have been quantized under one and left float under the other.
"""
import copy

import pytest
import torch
from torch import nn

import dal
from dal.nn import QATModule
from export_common import prepared


class Block(nn.Module):
    """Its forward has a functional add (prepare rewrites it) and a plain attribute the parent reads."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.scale_hint = 3

    def forward(self, x):
        return self.conv(x) + x


class ReadsChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block = nn.Conv2d(3, 4, 1), Block()

    def forward(self, x):
        return self.block(self.stem(x)) * self.block.scale_hint


def test_a_rewritten_child_keeps_its_attributes():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    float_model = ReadsChild().eval()
    want = float_model(x)
    qat = prepared(ReadsChild().eval(), x, "int8_balanced", "a2000")
    assert isinstance(qat.block, torch.fx.GraphModule) and qat.block.scale_hint == 3
    qat.load_state_dict(float_model.state_dict(), strict=False)
    dal.prepare.set_quantizer_state(qat, "off")
    assert torch.equal(qat(x), want)  # quantizers off: the float computation, with the * 3 the parent read
    # copy.deepcopy (dal.convert's first step, users' EMA / teacher copies) keeps the attribute:
    # fx.GraphModule's own deepcopy drops every attribute its graph does not use.
    copied = copy.deepcopy(qat)
    assert copied.block.scale_hint == 3 and torch.equal(copied(x), want)


def test_raft_reads_its_update_blocks_hidden_state_size():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    float_model = tv.models.optical_flow.raft_small(weights=None).eval()
    x = (torch.randn(1, 3, 128, 128), torch.randn(1, 3, 128, 128))
    qat = dal.prepare_qat(float_model, recipe="int8_balanced", hardware="a2000", example_inputs=x)
    assert qat.update_block.hidden_state_size == 96  # raft_small's, read by RAFT.forward
    dal.calibrate(qat, [(x,)], progress=False)
    # dal.convert deep-copies the model (before a forward: RAFT's CorrBlock then caches its pyramid,
    # non-leaf tensors deepcopy refuses)
    assert copy.deepcopy(qat).update_block.hidden_state_size == 96
    flows = qat.eval()(*x)
    assert len(flows) == 12 and flows[-1].shape == (1, 2, 128, 128) and torch.isfinite(flows[-1]).all()


class Shared(nn.Module):
    """``pos`` is one module under two names: the root's and the block's (as CoaT's ``cpe``)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.stem = nn.Conv2d(3, 4, 1)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 1))
        self.block.pos = self.pos

    def forward(self, x):
        y = self.stem(x)
        y = self.block.pos(y) + y
        return self.block[0](y) + y


def _slots(model, mod):
    return [n for n, m in model.named_modules(remove_duplicate=False) if m is mod]


def test_a_module_under_two_names_is_swapped_under_both():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    qat = prepared(Shared().eval(), x, "int8_balanced", "a2000")
    q = qat.get_submodule("pos")  # fx calls it by its first name; the root's GraphModule keeps that one
    assert isinstance(q, QATModule) and q.input_quant.initialized  # it ran, quantized, and calibrated
    assert not any(type(m) is nn.Conv2d for m in qat.modules())


def test_coat_shares_cpe_under_two_names():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    qat = dal.prepare_qat(timm.create_model("coat_lite_tiny", img_size=64).eval(), recipe="int8_balanced",
                          hardware="a2000", example_inputs=(x,))
    cpe = qat.get_submodule("serial_blocks1.0.cpe")
    assert cpe is qat.get_submodule("serial_blocks1.1.cpe") and isinstance(cpe.proj, QATModule)
    assert not any(type(m) in (nn.Conv2d, nn.Linear) for m in qat.modules())
    dal.calibrate(qat, [x], progress=False)
    # its functional ops (prepare rewrote its forward) ran under the blocks' names too: calibrated
    quantizers = [(n, m) for n, m in cpe.named_modules() if type(m).__name__ == "FakeQuantizer"]
    assert len(quantizers) > 3 and all(m.initialized for n, m in quantizers), [n for n, m in quantizers if not m.initialized]
    assert torch.isfinite(qat.eval()(x)).all()
