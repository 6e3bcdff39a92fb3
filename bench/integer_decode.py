"""Benchmark: the integer model's (``dal.convert``) decode and prefill step against the float eager
model, A/B between two dal source trees (issue 43, Performance).

The model and inputs are bench/llm_int_profile.py's (bench/llm_npu.py's tiny Llama, ``w4a8_int8_llm``
plus an INT8 KV-cache rule on the a2000; decode: one token at position 128 with a cache of 256, prefill:
128 tokens), one thread, ``OPENBLAS_NUM_THREADS=1``.

- worker (``--worker OUT``): builds the models with the ``dal`` it imports, runs ``--reps`` interleaved
  repetitions of (integer decode, float decode, integer prefill, float prefill), each timed by
  ``time.process_time`` over ``--inner`` calls, and writes their medians (CPU ms per call), the dal
  it ran and the integer model's outputs (``torch.save``) to OUT.
- driver (the default): runs the worker ``--rounds`` times for each tree, alternating (``--base``
  tree first, by ``PYTHONPATH``; then this checkout's ``dal``), and prints the medians over the
  rounds, the ratios float / integer (speed), and whether every output of the two trees is equal
  bit for bit. Each round is a fresh process: the trees never share a process, and alternation
  spreads the shared machine's load over both.

- split (``--split``): where one integer decode (or ``--prefill``) step of this checkout spends its CPU
  time, in context: the step run with one kind of module's forward replaced by a lookup of the
  outputs it returned in a first run (per module and call), interleaved with the unchanged step;
  the saving is that kind's cost in the step (quantizers inside a linear or a form are in both
  rows); "without NPUFloatOps" runs the whole step without the integer model's torch-function mode
  (other numbers: silu in torch's float32; the cost of the dispatch).

- floor (``--floor``): what a captured step (Python run once per graph, not per op and module) could
  reach at best: the aten ops of one integer decode (or ``--prefill``) step recorded (a
  ``TorchDispatchMode``) and replayed from Python on their recorded arguments, one call each, no
  module, form or quantizer code in between; the CPU time the step spends inside dal's C++ calls and
  numpy (which a capture keeps); the per-call cost of an aten overload against the torch-level call
  a captured graph makes; with ``--dynamo`` also ``torch.compile(step, backend="eager")`` as the
  model is today: its graphs, graph breaks, compile time, step time and outputs.

    .venv/bin/python bench/integer_decode.py --base /tmp/h3base [--rounds 4] [--reps 9] [--inner 5] [--compiled]
        [--blocks ''] [--base-blocks step]
    .venv/bin/python bench/integer_decode.py --split [--prefill] [--reps 15]
    .venv/bin/python bench/integer_decode.py --floor [--prefill] [--reps 15] [--dynamo]

``--compiled``: this tree's integer models captured with ``IntegerModel.compile_blocks(--blocks)`` after
their first forward (default ``''``: the whole net, the codes boundary included; ``step``: the
DecoderStep, embedding to ``lm_head``; ``step.lm.model.layers``: each decoder layer); ``--base-blocks``:
the base tree's too (default: eager).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("int decode", "float decode", "int prefill", "float prefill")


def worker(out: str, reps: int, inner: int, blocks: str | None = None) -> None:
    """Time the four runs (module doc) with the ``dal`` on ``sys.path``; write the results to ``out``.
    ``blocks``: the integer models' submodule path captured (``IntegerModel.compile_blocks``) after
    their first forward (None: eager)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    import llm_int_profile

    import dal

    int_pre, int_dec, pre_in, dec_in, float_pre, float_dec, _ = llm_int_profile.models()
    if blocks is not None:
        with torch.no_grad():
            for m, x in ((int_dec, dec_in), (int_pre, pre_in)):
                m(*x)
                m.compile_blocks(blocks)
    runs = {"int decode": lambda: int_dec(*dec_in), "float decode": float_dec,
            "int prefill": lambda: int_pre(*pre_in), "float prefill": float_pre}
    with torch.no_grad():
        outputs = {"decode": [t.clone() for t in int_dec(*dec_in)], "prefill": [t.clone() for t in int_pre(*pre_in)]}
        for f in runs.values():
            f()
        ms = {k: [] for k in runs}
        for _ in range(reps):
            for k, f in runs.items():
                c = time.process_time()
                for _ in range(inner):
                    f()
                ms[k].append((time.process_time() - c) * 1e3 / inner)
    torch.save({"dal": os.path.dirname(os.path.dirname(os.path.abspath(dal.__file__))),
                "ms": {k: statistics.median(v) for k, v in ms.items()}, "outputs": outputs}, out)


def run_worker(tree: str | None, reps: int, inner: int, d: str, tag: str, blocks: str | None = None) -> dict:
    """One worker process; ``tree``: a dal source tree put first on ``PYTHONPATH`` (None: this checkout)."""
    import torch

    out = os.path.join(d, f"{tag}.pt")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if tree is not None:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", out, "--reps", str(reps),
                    "--inner", str(inner)] + (["--blocks", blocks] if blocks is not None else []),
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return torch.load(out)


def main(base: str, rounds: int, reps: int, inner: int, blocks: str | None = None,
         base_blocks: str | None = None) -> str:
    import torch

    got = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for name, tree in (("base", base), ("this", None)):
                got[name].append(run_worker(tree, reps, inner, d, f"{name}{r}",
                                            blocks if name == "this" else base_blocks))
    trees = {name: got[name][0]["dal"] for name in got}
    same = all(torch.equal(a, b) for phase in ("decode", "prefill")
               for a, b in zip(got["base"][0]["outputs"][phase], got["this"][0]["outputs"][phase]))
    med = {name: {k: statistics.median(g["ms"][k] for g in got[name]) for k in KINDS} for name in got}
    lines = [f"dal trees: base {trees['base']}, this {trees['this']}; {rounds} alternating rounds (fresh processes) "
             f"x {reps} interleaved repetitions x {inner} calls; CPU ms per call (time.process_time), medians; "
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
             + (f"; this tree's integer models captured: compile_blocks({blocks!r})" if blocks is not None else "")
             + (f"; the base's: compile_blocks({base_blocks!r})" if base_blocks is not None else ""),
             f"every output (logits, KV codes) of the two trees equal bit for bit: {same}", "",
             "| phase | integer base | integer this | float eager (base run / this run) | ratio base | ratio this "
             "| integer step change |", "|---|---|---|---|---|---|---|"]
    for phase in ("decode", "prefill"):
        ib, it = med["base"][f"int {phase}"], med["this"][f"int {phase}"]
        fb, ft = med["base"][f"float {phase}"], med["this"][f"float {phase}"]
        lines.append(f"| {phase} | {ib:.2f} | {it:.2f} | {fb:.2f} / {ft:.2f} | {fb / ib:.2f}x | {ft / it:.2f}x "
                     f"| {it / ib - 1:+.0%} |")
    lines.append("")
    lines.append("per round (integer decode CPU ms, base / this): " + ", ".join(
        f"{b['ms']['int decode']:.2f} / {t['ms']['int decode']:.2f}" for b, t in zip(got["base"], got["this"])))
    text = "\n".join(lines)
    print(text)
    return text


def _step(prefill: bool) -> tuple:
    """``(integer model, its inputs, the float eager step)`` of the decode (or prefill) step, one
    torch thread, OpenBLAS pinned to one thread."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    import llm_int_profile

    int_pre, int_dec, pre_in, dec_in, float_pre, float_dec, _ = llm_int_profile.models()
    return (int_pre, pre_in, float_pre) if prefill else (int_dec, dec_in, float_dec)


def split(prefill: bool, reps: int) -> str:
    """The in-context cost of each kind of integer-model module (module doc), as a markdown table."""
    import collections

    model, inputs, fp = _step(prefill)
    import torch

    from dal.convert import api, attention, blocked_linear, layers, quant_calls, rmsnorm

    kinds = {"linears (IntegerLayer, their output quantizers included)": (layers.IntegerLayer, "forward"),
             "linears: the blocked matmul alone (BlockedWeights.value)": (blocked_linear.BlockedWeights, "value"),
             "linears: the blocked sums with their input codes (BlockedWeights.input_value, the C++ call)":
                 (blocked_linear.BlockedWeights, "input_value"),
             "quantizers (IntegerQuantizer), every call": (quant_calls.IntegerQuantizer, "forward"),
             "RMSNorm islands (RMSNormForm)": (rmsnorm.RMSNormForm, "forward"),
             "attention products (MatMulForm)": (attention.MatMulForm, "forward"),
             "softmax (SoftmaxForm)": (attention.SoftmaxForm, "forward")}
    origs = {k: getattr(c, m) for k, (c, m) in kinds.items()}
    mode = api.NPUFloatOps
    store, count = {}, collections.Counter()

    def looked_up(k):
        f = origs[k]

        def g(self, *a, **kw):
            key = (k, id(self), count[k, id(self)])
            count[k, id(self)] += 1
            if key not in store:
                store[key] = f(self, *a, **kw)
            return store[key]
        return g

    class NoMode:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def use(v):
        for k, (c, m) in kinds.items():
            setattr(c, m, looked_up(k) if v == k else origs[k])
        api.NPUFloatOps = NoMode if v == "without NPUFloatOps' dispatch" else mode

    def run(v):
        if v == "float eager":
            return fp()
        count.clear()
        return model(*inputs)
    variants = ["step"] + list(kinds) + ["without NPUFloatOps' dispatch", "float eager"]
    ms = {v: [] for v in variants}
    inner = 1 if prefill else 3
    with torch.no_grad():
        try:
            for v in variants:
                use(v)
                run(v)
            for _ in range(reps):
                for v in variants:
                    use(v)
                    run(v)
                    c = time.process_time()
                    for _ in range(inner):
                        run(v)
                    ms[v].append((time.process_time() - c) * 1e3 / inner)
        finally:
            use("step")
    step = statistics.median(ms["step"])
    lines = [f"{'prefill' if prefill else 'decode'} step of the integer model, {reps} interleaved repetitions, "
             f"median CPU ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", "",
             "| part | step without it, CPU ms | its cost in the step, CPU ms | share |", "|---|---|---|---|"]
    for v in variants:
        m = statistics.median(ms[v])
        if v == "step":
            lines.append(f"| **whole step** | {m:.2f} | | |")
        elif v == "float eager":
            lines.append(f"| (float eager step, transformers: its own CPU ms) | {m:.2f} | | |")
        else:
            lines.append(f"| {v} | {m:.2f} | {step - m:.2f} | {(step - m) / step:.0%} |")
    text = "\n".join(lines)
    print(text)
    return text


def _ext_timers(record: list):
    """Wrap dal's C++ calls (the fake-quant and blocked-sum kernels) and the numpy routines of the
    integer model (softmax's exp, the float-island MatMul) so that each call's CPU seconds are appended
    to ``record``; returns the function that undoes it."""
    from dal.convert import attention
    from dal.convert import matmul_f64 as float_island_matmul
    from dal.formats import native
    from dal.kernels import blocked_sums

    undo = []

    def timed(f):
        def g(*a):
            c = time.process_time()
            out = f(*a)
            record.append(time.process_time() - c)
            return out
        return g
    for lib, names in ((native.library(), ("dal_fq_forward_fixed", "dal_fp_cast_round_trip", "dal_fq_forward")),
                       (blocked_sums.library(), ("dal_blocked_linear_q", "dal_blocked_linear"))):
        for n in names if lib is not None else ():
            f = getattr(lib, n)
            setattr(lib, n, timed(f))
            undo.append((lib, n, f))
    for mod, n in ((attention, "exp_f32"), (float_island_matmul, "matmul_f64")):
        f = getattr(mod, n)
        setattr(mod, n, timed(f))
        undo.append((mod, n, f))

    def restore():
        for obj, n, f in undo:
            setattr(obj, n, f)
    return restore


def floor(prefill: bool, reps: int, dynamo: bool) -> str:
    """The floor of a captured integer step (module doc), as markdown lines."""
    import collections

    model, inputs, fp = _step(prefill)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode  # measurement only: the aten ops of a step


    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is not torch.ops.aten._local_scalar_dense.default:  # .item(): a host read, not an op
                self.ops.append((func, args, kwargs))
            return out

    ext: list = []
    lines = []
    with torch.no_grad():
        model(*inputs)
        with Recorder() as rec:
            model(*inputs)
        ops = rec.ops

        def replay():
            for f, a, k in ops:
                f(*a, **k)
        restore = _ext_timers(ext)
        try:
            ext.clear()
            model(*inputs)
            n_ext = len(ext)
            ms = collections.defaultdict(list)
            inner = 1 if prefill else 5
            for _ in range(reps):
                for name, f in (("step", lambda: model(*inputs)), ("aten replay", replay), ("float eager", fp)):
                    f()
                    ext.clear()
                    c = time.process_time()
                    for _ in range(inner):
                        f()
                    ms[name].append((time.process_time() - c) * 1e3 / inner)
                    if name == "step":
                        ms["C++ / numpy inside the step"].append(sum(ext) * 1e3 / inner)
        finally:
            restore()
        per_op = collections.defaultdict(float)
        for f, a, k in ops:
            c = time.perf_counter()
            f(*a, **k)
            per_op[str(f)] += time.perf_counter() - c
        x, y = torch.randn(1, 256), torch.randn(1, 256)
        aten = torch.ops.aten
        pairs = (("view", lambda: aten.view.default(x, [256]), lambda: x.view(256)),
                 ("mul", lambda: aten.mul.Tensor(x, y), lambda: x * y),
                 ("to float64", lambda: aten._to_copy.default(x, dtype=torch.float64), lambda: x.double()))
        call_us = {}
        for name, fa, ft in pairs:
            got = []
            for f in (fa, ft):
                for _ in range(2000):
                    f()
                c = time.perf_counter()
                for _ in range(20000):
                    f()
                got.append((time.perf_counter() - c) / 20000 * 1e6)
            call_us[name] = got
    med = {k: statistics.median(v) for k, v in ms.items()}
    phase = "prefill" if prefill else "decode"
    lines += [f"{phase} step of the integer model: floor of a captured step; {reps} interleaved repetitions, "
              f"median CPU ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", "",
              "| part | CPU ms |", "|---|---|",
              f"| the step as it runs | {med['step']:.2f} |",
              f"| its {len(ops)} aten ops replayed from Python, one call each (no module / form / quantizer code) "
              f"| {med['aten replay']:.2f} |",
              f"| dal's C++ kernels and numpy inside the step ({n_ext} calls) | "
              f"{med['C++ / numpy inside the step']:.2f} |",
              f"| floor of a Python-level capture (the two above) | "
              f"{med['aten replay'] + med['C++ / numpy inside the step']:.2f} |",
              f"| float eager step (transformers) | {med['float eager']:.2f} |", "",
              "per-call cost, us (aten overload as replayed / the torch-level call a captured graph makes): " +
              ", ".join(f"{k} {a:.2f} / {t:.2f}" for k, (a, t) in call_us.items()), "",
              "the replay's time by aten op (one pass, ms): " + ", ".join(
                  f"{k.replace('aten.', '')} {v * 1e3:.2f}" for k, v in
                  sorted(per_op.items(), key=lambda kv: -kv[1])[:12])]
    if dynamo:
        lines += [""] + _dynamo_probe(model, inputs)
    text = "\n".join(lines)
    print(text)
    return text


def _dynamo_probe(model, inputs) -> list:
    """``torch.compile(model, backend=<eager, counting graphs>)`` on today's integer model: its graphs,
    graph breaks, compile CPU seconds, step CPU ms against the eager step, and whether its outputs are equal."""
    import torch

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward
    torch._dynamo.config.cache_size_limit = 64
    with torch.no_grad():
        want = [t.clone() for t in model(*inputs)]
        compiled = torch.compile(model, backend=backend)
        c = time.process_time()
        got = compiled(*inputs)
        first = time.process_time() - c
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        ms = {"eager": [], "compiled": []}
        for _ in range(5):
            for name, f in (("eager", model), ("compiled", compiled)):
                f(*inputs)
                c = time.process_time()
                for _ in range(5):
                    f(*inputs)
                ms[name].append((time.process_time() - c) * 200)
    return [f"torch.compile(backend=eager) of the integer step as it is: {len(graphs)} graphs ({sum(graphs)} fx nodes), "
            f"first call (compile) {first:.1f} CPU s, step {statistics.median(ms['compiled']):.2f} CPU ms against "
            f"{statistics.median(ms['eager']):.2f} eager; outputs equal: {same}"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the dal source tree to compare with (e.g. a `git worktree add` of the commit before)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--split", action="store_true", help="where this checkout's integer step spends its time")
    ap.add_argument("--prefill", action="store_true", help="--split / --floor: the prefill step (default: decode)")
    ap.add_argument("--floor", action="store_true", help="the floor of a captured integer step (module doc)")
    ap.add_argument("--dynamo", action="store_true", help="--floor: also torch.compile(backend='eager') as it is")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--compiled", action="store_true",
                    help="this tree's integer models captured (IntegerModel.compile_blocks(--blocks))")
    ap.add_argument("--blocks", help="--compiled: the submodule path captured "
                                     "(default '': the whole net, codes boundary included)")
    ap.add_argument("--base-blocks", help="the base tree's integer models captured too (e.g. step.lm.model.layers)")
    a = ap.parse_args()
    if a.split:
        split(a.prefill, a.reps)
    elif a.floor:
        floor(a.prefill, a.reps, a.dynamo)
    elif a.worker:
        worker(a.worker, a.reps, a.inner, a.blocks)
    else:
        if not a.base:
            ap.error("--base TREE is required")
        blocks = (a.blocks if a.blocks is not None else "") if a.compiled else None
        main(a.base, a.rounds, a.reps, a.inner, blocks, a.base_blocks)
