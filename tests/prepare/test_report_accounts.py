"""prepare's report accounts for every module and functional op that runs (issue 41, Checks).

The oracle is a recorder written here, not dal's capture: forward hooks on every module of the
float model (which leaf modules run, and which module's forward is running) and a public
``torch.overrides.TorchFunctionMode`` that counts the functional calls dal quantizes (``+``,
``*``, ``@``, ``cat`` of floating-point tensors of rank >= 1, both operands tensors) per
module forward. Then, on the same model prepared with ``int8_balanced`` for the a2000:

* every leaf module that ran has a row of its own, or its forward's ops are rows
  (``<path>.<op>``), or a row names it (a BatchNorm / ReLU folded into its conv), or it lies in
  a module swapped whole; on a detector's host side (outside ``backbone`` and ``head`` /
  ``rpn.head``) a module without weights (transform, anchors, RoI pooling) may instead be named,
  or lie inside a module named, in a "host side" note;
* for each module forward on the NPU side, the report has as many rows of each op class as
  the recorder counted calls in one run of that forward (rows are attributed to their owner by
  path: ``<owner>.<node>`` in a traced forward, ``<owner>.dal_sites.<site>`` by call site),
  except calls made inside a helper function that has a row of its own, left in float with its
  reason (a function torch.fx keeps whole, e.g. Swin's ``shifted_window_attention``);
* every row's status is one of the report's statuses, and a row left in float says why.
"""
from __future__ import annotations

import collections
import copy
import inspect
import os
import re
import sys

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import dal
from dal.prepare.report import STATUSES
from dal_examples.zoo import MnistCNN, MobileNetTiny

torchvision = pytest.importorskip("torchvision")

_NAMES = {"add": {"add", "__add__", "__radd__", "__iadd__", "add_"},
          "mul": {"mul", "__mul__", "__rmul__", "__imul__", "mul_"},
          "matmul": {"matmul", "__matmul__", "bmm"},
          "cat": {"cat", "concat", "concatenate"}}
_KIND = {name: kind for kind, names in _NAMES.items() for name in names}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _float_tensor(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0


class Recorder(TorchFunctionMode):
    """Leaf modules that run, and per (module path, kind, helpers) the most calls one run of that
    module's forward made itself (calls inside a submodule's forward count for the submodule).
    ``helpers``: the Python functions between the forward and the call (``shifted_window_attention``
    called by Swin's attention forward), innermost last; torch's own frames are skipped."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.names = {id(m): n for n, m in model.named_modules()}
        self.leaves: dict[str, None] = {}
        self.calls: collections.Counter = collections.Counter()  # (owner, kind, helpers) -> count
        self._stack: list = []
        self._hooks = [h for m in model.modules() for h in (
            m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave, always_call=True))]

    def _enter(self, module, args):
        forward = inspect.unwrap(type(module).forward)
        self._stack.append((self.names[id(module)], getattr(forward, "__code__", None), collections.Counter()))
        if next(module.children(), None) is None:
            self.leaves[self.names[id(module)]] = None

    def _leave(self, module, args, out):
        path, _, counts = self._stack.pop()
        for (kind, helpers), n in counts.items():
            self.calls[(path, kind, helpers)] = max(self.calls[(path, kind, helpers)], n)

    def _helpers(self, code) -> tuple:
        frame, names = sys._getframe(2), []
        while frame is not None and frame.f_code is not code:
            if not frame.f_code.co_filename.startswith(_TORCH_DIR) and not frame.f_code.co_name.startswith("<"):
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        return tuple(reversed(names)) if frame is not None else ()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _KIND.get(getattr(func, "__name__", ""))
        if kind is not None and self._stack:
            if kind == "cat":
                seq = args[0] if args else kwargs.get("tensors", ())
                counted = isinstance(seq, (list, tuple)) and len(seq) >= 2 and all(map(_float_tensor, seq))
            else:
                counted = len(args) >= 2 and _float_tensor(args[0]) and _float_tensor(args[1])
            if counted:
                self._stack[-1][2][(kind, self._helpers(self._stack[-1][1]))] += 1
        return func(*args, **kwargs)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _owner(row_name: str) -> str:
    if row_name.startswith("dal_sites.") or ".dal_sites." in row_name:
        return row_name.split("dal_sites.")[0].rstrip(".")
    return row_name.rpartition(".")[0]


def _named(path: str, text: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(path)}(?![\w.])", text) is not None


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _npu_side(path: str, npu: tuple) -> bool:
    return not npu or any(path == p or path.startswith(p + ".") for p in npu)


def check_accounts(model: nn.Module, run, npu: tuple = (), example_inputs=None) -> dict:
    """Record ``run(float copy)``, prepare ``model`` (with ``example_inputs`` when given: the
    report then also carries what prepare's own float forward decided), compare; returns counts
    for the caller."""
    float_model = copy.deepcopy(model).eval()
    rec = Recorder(float_model)
    try:
        with rec, torch.no_grad():
            run(float_model)
    finally:
        rec.close()
    prepared = dal.prepare_qat(model, recipe="int8_balanced", hardware="a2000", example_inputs=example_inputs)
    report = dal.prepared(prepared).report
    rows = report.rows
    names = {r.name for r in rows}
    details = " ".join(r.detail for r in rows)
    host_notes = " ".join(n.split(":")[0] for n in report.notes if "host side" in n)
    bad = [r for r in rows if r.status not in STATUSES or (r.status == "float" and not r.detail.strip())]
    assert not bad, f"rows with an unknown status or left in float without a reason: {bad[:5]}"
    missing = []
    for leaf in rec.leaves:
        if leaf in names or any(n.startswith(leaf + ".") for n in names) or _named(leaf, details):
            continue
        if any(a in names for a in _ancestors(leaf)[1:]):
            continue  # inside a module swapped whole
        weights = next(float_model.get_submodule(leaf).parameters(), None) is not None
        if not _npu_side(leaf, npu) and not weights and any(_named(a, host_notes) for a in _ancestors(leaf)):
            continue  # a host module without weights (transform, anchors, RoI pooling): the note names it
        missing.append(leaf)
    assert not missing, f"leaf modules that ran and are not in the report: {missing[:10]} ({len(missing)})"
    module_paths = {n for n, _ in float_model.named_modules()}
    listed = collections.Counter((_owner(r.name), r.op_class) for r in rows
                                 if r.op_class in _NAMES and r.name not in module_paths)
    direct: collections.Counter = collections.Counter()
    for (owner, kind, helpers), n in rec.calls.items():
        prefix = f"{owner}." if owner else ""
        whole = [r for r in rows for h in helpers if re.fullmatch(rf"{re.escape(prefix + h)}(_\d+)?", r.name)]
        if whole:  # the helper call is one row (a function fx keeps whole): its ops are not rows
            assert all(r.status == "float" and r.detail for r in whole), whole
        else:
            direct[(owner, kind)] += n
    wrong = []
    for (owner, kind), n in direct.items():
        if not _npu_side(owner, npu):
            if not (owner and any(_named(a, host_notes) for a in _ancestors(owner))) and \
                    not (owner == "" and "<root>" in host_notes):
                wrong.append((owner or "<root>", kind, n, "host op not named"))
            continue
        if listed[(owner, kind)] != n:
            wrong.append((owner or "<root>", kind, n, listed[(owner, kind)]))
    extra = [(o, k, c) for (o, k), c in listed.items() if c and (o, k) not in direct and _npu_side(o, npu)]
    assert not wrong, f"(owner, op, calls recorded, rows in the report): {wrong[:10]}"
    assert not extra, f"report rows for ops the float forward never called: {extra[:10]}"
    return {"leaves": len(rec.leaves), "calls": sum(rec.calls.values()), "rows": len(rows), "recorder": rec,
            "prepared": prepared}


def pad_and_join(x, y):
    """A helper torch.fx keeps whole (wrapped below): prepare sees one call, not its cat and add."""
    return torch.cat([x, y], dim=1) + torch.cat([y, x], dim=1)


torch.fx.wrap("pad_and_join")


class WrappedHelperNet(nn.Module):
    """Two convs joined by a wrapped helper function, then a conv and a residual ``+``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = pad_and_join(self.a(x), self.b(x))
        return self.c(y) + y


CLASSIFIERS = {
    "WrappedHelperNet": (WrappedHelperNet, (1, 1, 8, 8)),
    "MnistCNN": (MnistCNN, (1, 1, 28, 28)),
    "MobileNetTiny": (MobileNetTiny, (1, 1, 28, 28)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(weights=None), (1, 3, 32, 32)),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(weights=None), (1, 3, 32, 32)),
    "shufflenet_v2_x0_5": (lambda: torchvision.models.shufflenet_v2_x0_5(weights=None), (1, 3, 32, 32)),
}


@pytest.mark.parametrize("name", list(CLASSIFIERS))
def test_report_accounts_for_every_module_and_op_of_a_classifier(name):
    make, shape = CLASSIFIERS[name]
    torch.manual_seed(0)
    x = torch.randn(shape)
    counts = check_accounts(make(), lambda m: m(x))
    assert counts["leaves"] >= 3


@pytest.mark.parametrize("name", ["MnistCNN", "mobilenet_v3_small"])
def test_report_accounts_with_example_inputs(name):
    """Prepared with example inputs (one float forward before apply decides which modules run and
    which produce the outputs): the report, rendered from the plan, still accounts for everything."""
    make, shape = CLASSIFIERS[name]
    torch.manual_seed(0)
    x = torch.randn(shape)
    counts = check_accounts(make(), lambda m: m(x), example_inputs=(x,))
    assert counts["leaves"] >= 3
    # the capture record prepare kept (dal.prepared(model).calls, dal.capture) holds what the
    # recorder here saw: the leaf modules that ran, and per owner the + * @ cat of float tensors
    rec, calls = counts["recorder"], dal.prepared(counts["prepared"]).calls
    assert calls, "prepare with example inputs keeps its record"
    assert {e.path for e in calls if e.kind == "module" and e.path in rec.leaves} == set(rec.leaves)
    seen = collections.Counter()
    for e in calls:
        kind = _KIND.get(e.name) if e.kind == "function" else None
        if kind is not None and sum(m.dtype.is_floating_point and len(m.shape) >= 1 for m in e.in_meta) >= 2:
            seen[(e.path, kind)] += 1
    want = collections.Counter()
    for (owner, kind, _), n in rec.calls.items():
        want[(owner, kind)] += n
    assert seen == want and (name == "MnistCNN" or sum(seen.values()) > 0)


DETECTORS = {  # the NPU side of each (the rest is the host's: transform, RPN / RoI heads' logic, NMS)
    "fasterrcnn_mobilenet_v3_large_fpn": ("backbone", "rpn.head"),
    "fcos_resnet50_fpn": ("backbone", "head"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DETECTORS))
def test_report_accounts_for_every_module_and_op_of_a_detector(name):
    from torchvision.models import detection

    torch.manual_seed(0)
    model = getattr(detection, name)(weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64)
    images = [torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(1))]
    counts = check_accounts(model, lambda m: m(images), DETECTORS[name])
    assert counts["calls"] > 0
