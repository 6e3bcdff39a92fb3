"""dal.capture's record of one forward, checked against captures dal did not write.

* torch.fx (``symbolic_trace`` + ``ShapeProp``) on models it traces: the record's leaf-module calls
  and the function calls made outside leaf modules are fx's nodes, one for one, in order, with the
  same output shapes, and every data-flow edge fx states (which node's output a node reads) is
  the record's (which call wrote the value a call reads);
* ``torch.export`` (``strict=False``) on a forward torch.fx cannot trace (torchvision's
  FeaturePyramidNetwork, a loop over a dict of levels): the convolutions per module path and the
  top-level add / resize with their shapes, from the aten graph's ``nn_module_stack``;
* the record's own contract, each by a hand-built model: in-place calls write a new value, an
  opaque module is one call with new output values, shape queries are not calls, call sites are
  the source lines of this file, keyword inputs are read, and an exception leaves no hook behind.
"""
from __future__ import annotations

import inspect
import pickle

import pytest
import torch
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from dal.capture import capture, capturing

torchvision = pytest.importorskip("torchvision")


def _fx_leaf(mod: nn.Module) -> bool:
    """torch.fx's default leaf rule: a module of torch.nn that is not a Sequential."""
    return (mod.__module__.startswith("torch.nn") or mod.__module__.startswith("torch.ao.nn")) and \
        not isinstance(mod, nn.Sequential)


def _aligned(model: nn.Module, x: torch.Tensor):
    """(fx nodes with a tensor output, the record's calls fx has a node for, the record)."""
    gm = torch.fx.symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    nodes = [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")
             and isinstance(n.meta.get("tensor_meta"), torch.fx.passes.shape_prop.TensorMetadata)]
    leaves = {p for p, m in model.named_modules() if p and _fx_leaf(m)}
    with torch.no_grad():
        record = capture(model, x)
    calls = [c for c in record.calls if (c.kind == "module" and c.path in leaves)
             or (c.kind == "function" and c.path not in leaves)]
    return gm, nodes, calls, record


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_calls_and_data_flow_are_torch_fx_nodes(name):
    model = getattr(torchvision.models, name)(num_classes=10).eval()
    x = torch.randn(1, 3, 64, 64)
    gm, nodes, calls, record = _aligned(model, x)
    assert len(calls) == len(nodes), [(c.kind, c.path) for c in calls][:5]
    for n, c in zip(nodes, calls):
        if n.op == "call_module":
            assert c.kind == "module" and c.path == n.target, (n, c.path)
        else:
            assert c.kind == "function", (n, c.path)
        assert c.out_meta[0].shape == tuple(n.meta["tensor_meta"].shape), (n, c.out_meta)
    # data flow: the record's writer of each value a call reads is the call of fx's argument node
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    index = {n: i for i, n in enumerate(nodes)}
    writer = {}
    for i, c in enumerate(calls):
        for k in c.outs:
            writer[k] = i
    x_key = record.calls[0].ins[0]
    for n, c in zip(nodes, calls):
        want = sorted(index[a] if a is not placeholder else -1 for a in n.all_input_nodes
                      if a is placeholder or a in index)
        got = sorted(writer.get(k, -1 if k == x_key else None) for k in c.ins)
        got = [g for g in got if g is not None] if n.op == "call_module" else got
        assert got == want, (n, got, want)
    assert record.outputs == calls[-1].outs and record.ran


def test_untraceable_forward_matches_torch_export():
    from torchvision.ops import FeaturePyramidNetwork

    fpn = FeaturePyramidNetwork([8, 16, 32], 8).eval()
    feats = {"a": torch.randn(1, 8, 16, 16), "b": torch.randn(1, 16, 8, 8), "c": torch.randn(1, 32, 4, 4)}
    with pytest.raises(Exception):
        torch.fx.symbolic_trace(fpn)  # the reason this forward needs a recorded run
    program = torch.export.export(fpn, (feats,), strict=False)
    convs, top = [], []
    for n in program.graph.nodes:
        if n.op != "call_function":
            continue
        stack = n.meta.get("nn_module_stack", {})
        path = list(stack.values())[-1][0] if stack else ""
        if n.target is torch.ops.aten.conv2d.default:
            convs.append((path, tuple(n.meta["val"].shape)))
        elif not path:
            top.append((n.target._opname, tuple(n.meta["val"].shape)))
    with torch.no_grad():
        record = capture(fpn, feats)
    assert [(c.path, c.out_meta[0].shape) for c in record.modules() if isinstance(c.target, nn.Conv2d)] == convs
    own = [(c.op.name if c.op else c.target.__name__, c.out_meta[0].shape) for c in record.functions() if c.path == ""]
    assert [(("resize" if o == "upsample_nearest2d" else o), s) for o, s in top] == own


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.inner = nn.Sequential(nn.Conv2d(4, 4, 1), nn.ReLU())

    def forward(self, x, *, scale=None):
        y = self.conv(x)
        y.relu_()
        n = y.shape[1] + y.dim()  # shape queries: no calls
        z = self.inner(y) * scale + n
        return torch.cat([y, z], dim=1)


def _line(fragment: str) -> str:
    """``test_record.py:<line>`` of the first source line of ``_Block.forward`` holding ``fragment``."""
    lines, start = inspect.getsourcelines(_Block.forward)
    return f"test_record.py:{start + next(i for i, s in enumerate(lines) if fragment in s)}"


def test_contract_in_place_sites_kwargs_and_opaque():
    block = _Block().eval()
    x, scale = torch.randn(1, 3, 4, 4), torch.tensor(2.0)
    with torch.no_grad():
        record = capture(block, x, scale=scale)
    names = [(c.kind, c.path, c.target.__name__ if c.kind == "function" else type(c.target).__name__)
             for c in record.calls]
    assert names == [("function", "conv", "conv2d"), ("module", "conv", "Conv2d"),
                     ("function", "", "relu_"),
                     ("function", "inner.0", "conv2d"), ("module", "inner.0", "Conv2d"),
                     ("function", "inner.1", "relu"), ("module", "inner.1", "ReLU"), ("module", "inner", "Sequential"),
                     ("function", "", "mul"), ("function", "", "add"), ("function", "", "cat"),
                     ("module", "", "_Block")]
    conv, _, relu_, *_ = record.calls
    assert relu_.ins == conv.outs and relu_.outs != relu_.ins  # in place: a new value of the same tensor
    assert relu_.site == _line("relu_") and record.calls[-2].site == _line("torch.cat")
    assert record.calls[0].site == _line("self.conv(x)")  # a leaf's own call: the line that called it
    root = record.calls[-1]
    assert len(root.ins) == 2 and root.in_meta[1].shape == ()  # the keyword input is read
    assert [c.depth for c in record.calls[:3]] == [2, 1, 1]
    # opaque: the Sequential is one call, nothing inside it; its output is a new value
    with torch.no_grad():
        hidden = capture(block, x, scale=scale, opaque=lambda m: isinstance(m, nn.Sequential))
    seq = next(c for c in hidden.calls if c.path == "inner")
    assert seq.opaque and not any(c.path.startswith("inner.") for c in hidden.calls)
    assert id(block.inner[0]) in hidden.called  # it still ran
    mul = next(c for c in hidden.calls if c.kind == "function" and c.target.__name__ == "mul")
    assert mul.ins[0] in seq.outs and seq.outs[0] not in seq.ins
    # plain data: the entries pickle (prepare keeps them on the model)
    entries = pickle.loads(pickle.dumps(record.entries()))
    assert [(e.kind, e.path, e.name) for e in entries] == names
    assert entries[2].op == "relu" and entries[-2].op == "cat"


def test_failed_forward_leaves_no_hook():
    block = _Block().eval()
    with pytest.raises(TypeError):
        capture(block, torch.randn(1, 3, 4, 4), scale=None)  # None * tensor fails inside
    assert not capturing()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in block.modules())
    with torch.no_grad():
        assert len(capture(block, torch.randn(1, 3, 4, 4), scale=torch.tensor(1.0)).calls) == 12


def test_a_module_called_twice_is_two_calls_and_a_script_module_is_none():
    lin = nn.Linear(4, 4)
    scripted = torch.jit.script(nn.ReLU())

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.act = lin, scripted

        def forward(self, x):
            return self.act(self.lin(self.lin(x)))

    with torch.no_grad():
        record = capture(Twice(), torch.randn(2, 4))
    mods = [(c.path, c.in_meta[0].shape) for c in record.modules()]
    assert mods == [("lin", (2, 4)), ("lin", (2, 4)), ("", (2, 4))]
    first, second = [c for c in record.modules() if c.path == "lin"]
    assert second.ins == first.outs


def test_an_indexed_assignment_writes_a_new_version():
    class Assign(nn.Module):
        def forward(self, x):
            y = torch.zeros(2, 4)
            y[:, :2] = x * 2
            return y + 1

    with torch.no_grad():
        record = capture(Assign(), torch.ones(2, 2))
    zeros, mul, assign, add = record.functions()
    assert assign.target.__name__ == "__setitem__"
    assert set(zeros.outs) | set(mul.outs) <= set(assign.ins) and add.ins[0] == assign.outs[0] != zeros.outs[0]
