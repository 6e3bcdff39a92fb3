"""The time of ``dal.prepare_qat`` and the number of model forwards it makes (issue 41, Performance).

Models (random weights): torchvision ResNet-50 (1x3x224x224), FCOS ``fcos_resnet50_fpn``
(min_size = max_size = 128: its transform's size, the zero batch prepare captures on), and a
12-layer ``nn.TransformerEncoder`` (d_model 256, 4 heads, feed-forward 1024, batch-first,
1x16x256). Each is prepared with ``int8_balanced`` for the a2000, without and with
``example_inputs``; the encoder also with ``replace: [npu_attention]`` (operator replacement,
which validates its swaps with forwards of its own).

Forwards are counted by the benchmark, not by dal: a forward pre-hook on a *probe* module that
every forward of the model passes through and that prepare does not replace (ResNet-50
``layer1``, FCOS ``backbone.body.layer1``, the encoder's ``layers.0``; checked to be still in
the prepared model), and one on the root. Phases are timed, and their forwards counted, by
wrapping the functions ``dal.prepare.api`` calls (installed here, for the run only).

    python bench/prepare.py [--reps 3]      # prints the table and the phases
    python bench/prepare.py --write         # also writes them to bench/results/prepare.md (which
                                            # holds the before / after run and its reading)
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cpu import cpu_flags  # bench/cpu.py  # noqa: E402
from results_file import write_result  # bench/results_file.py  # noqa: E402

#: the functions of dal.prepare.api whose time and forwards are reported, in call order
PHASES = ("_check_example_inputs", "_replace_operators", "capture", "capture_sites", "build_plan", "host_steps",
          "check_plan", "check_constraints", "decide", "plan_actions", "apply_plan", "constraint_notes")


def models():
    """name -> (float model builder, example input tuple, probe path)."""
    import torchvision
    from torchvision.models import detection

    def encoder():
        layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
        return nn.TransformerEncoder(layer, 12, enable_nested_tensor=False).eval()

    def fcos():
        return detection.fcos_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3, min_size=128,
                                           max_size=128).eval()
    g = torch.Generator().manual_seed(0)
    return {
        "ResNet-50 (224)": (lambda: torchvision.models.resnet50(weights=None).eval(),
                            (torch.randn(1, 3, 224, 224, generator=g),), "layer1"),
        "FCOS ResNet-50 FPN (128)": (fcos, ([torch.rand(3, 128, 128, generator=g)],), "backbone.body.layer1"),
        "TransformerEncoder 12 x 256": (encoder, (torch.randn(1, 16, 256, generator=g),), "layers.0"),
    }


class Counter:
    """Forward pre-hooks on the root and the probe; phase wrappers read them."""

    def __init__(self, model: nn.Module, probe: str):
        self.root = self.probe = 0
        self.probe_module = model.get_submodule(probe)
        model.register_forward_pre_hook(lambda m, a: self._bump("root"))
        self.probe_module.register_forward_pre_hook(lambda m, a: self._bump("probe"))

    def _bump(self, which: str) -> None:
        setattr(self, which, getattr(self, which) + 1)


def _wrap_phases(record: dict, counter_ref: list):
    """Wrap PHASES in dal.prepare.api: each call adds (seconds, probe forwards) to ``record``."""
    import dal.prepare.api as api

    saved = {}
    for name in PHASES:
        fn = getattr(api, name)
        saved[name] = fn

        def timed(*a, _fn=fn, _name=name, **k):
            c = counter_ref[0]
            f0, t0 = c.probe, time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                s, f = record.get(_name, (0.0, 0))
                record[_name] = (s + time.perf_counter() - t0, f + c.probe - f0)
        setattr(api, name, timed)
    return saved


def _unwrap(saved: dict) -> None:
    import dal.prepare.api as api
    for name, fn in saved.items():
        setattr(api, name, fn)


def one_run(template: nn.Module, probe: str, recipe, example_inputs):
    """(seconds, probe forwards, root forwards, {phase: (s, forwards)}) of one prepare_qat."""
    import dal

    model = copy.deepcopy(template)
    counter = Counter(model, probe)
    record: dict = {}
    saved = _wrap_phases(record, [counter])
    try:
        t0 = time.perf_counter()
        out = dal.prepare_qat(model, recipe=recipe, hardware="a2000", example_inputs=example_inputs)
        dt = time.perf_counter() - t0
    finally:
        _unwrap(saved)
    if not any(m is counter.probe_module for m in out.modules()):
        raise RuntimeError(f"probe {probe} was replaced by prepare: its count is not the model's forwards")
    return dt, counter.probe, counter.root, record


def main(reps: int = 3) -> str:
    import warnings

    from dal.recipe import load_recipe

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    int8 = load_recipe("int8_balanced")
    with_attention = {**int8.to_dict(), "replace": ["npu_attention"], "name": "int8_balanced+npu_attention"}
    cases = []
    for name, (build, x, probe) in models().items():
        torch.manual_seed(0)
        template = build()
        cases.append((name, "int8_balanced", template, probe, int8, None))
        cases.append((name, "int8_balanced, example_inputs", template, probe, int8, x))
        if name.startswith("Transformer"):
            cases.append((name, "+ replace: [npu_attention], example_inputs", template, probe, with_attention, x))
    times = {i: [] for i in range(len(cases))}
    info = {}
    for _ in range(reps):  # interleaved: each repetition prepares every case once
        for i, (name, label, template, probe, recipe, x) in enumerate(cases):
            dt, fwd, root, record = one_run(template, probe, recipe, x)
            times[i].append(dt)
            info[i] = (fwd, root, record)
    lines = ["# prepare_qat: time and forwards (bench/prepare.py)", "",
             f"CPU: {cpu_flags()}; one torch thread; {reps} interleaved repetitions, median wall time. "
             "The machine is shared: absolute times swing 1.5-2x between runs. Hardware a2000.", "",
             "| model | recipe / call | prepare_qat s (median) | forwards (probe) | root forwards |",
             "|---|---|---|---|---|"]
    for i, (name, label, *_rest) in enumerate(cases):
        fwd, root, _ = info[i]
        lines.append(f"| {name} | {label} | {statistics.median(times[i]):.2f} | {fwd} | {root} |")
    lines += ["", "## Phases (last repetition): seconds / forwards", ""]
    for i, (name, label, *_rest) in enumerate(cases):
        record = info[i][2]
        parts = [f"{p} {s:.2f}s" + (f" / {f} fwd" if f else "") for p, (s, f) in
                 sorted(record.items(), key=lambda kv: PHASES.index(kv[0])) if s >= 0.01 or f]
        lines.append(f"- {name}, {label}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--write", action="store_true", help="write bench/results/prepare.md (the table only)")
    text = main(ap.parse_args().reps)
    print(text)
    if ap.parse_args().write:
        write_result("prepare.md", text)
