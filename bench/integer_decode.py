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

    .venv/bin/python bench/integer_decode.py --base /tmp/h3base [--rounds 4] [--reps 9] [--inner 5]
    .venv/bin/python bench/integer_decode.py --split [--prefill] [--reps 15]
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


def worker(out: str, reps: int, inner: int) -> None:
    """Time the four runs (module doc) with the ``dal`` on ``sys.path``; write the results to ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    import llm_int_profile

    import dal

    int_pre, int_dec, pre_in, dec_in, float_pre, float_dec, _ = llm_int_profile.models()
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


def run_worker(tree: str | None, reps: int, inner: int, d: str, tag: str) -> dict:
    """One worker process; ``tree``: a dal source tree put first on ``PYTHONPATH`` (None: this checkout)."""
    import torch

    out = os.path.join(d, f"{tag}.pt")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if tree is not None:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", out, "--reps", str(reps),
                    "--inner", str(inner)], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return torch.load(out)


def main(base: str, rounds: int, reps: int, inner: int) -> str:
    import torch

    got = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for name, tree in (("base", base), ("this", None)):
                got[name].append(run_worker(tree, reps, inner, d, f"{name}{r}"))
    trees = {name: got[name][0]["dal"] for name in got}
    same = all(torch.equal(a, b) for phase in ("decode", "prefill")
               for a, b in zip(got["base"][0]["outputs"][phase], got["this"][0]["outputs"][phase]))
    med = {name: {k: statistics.median(g["ms"][k] for g in got[name]) for k in KINDS} for name in got}
    lines = [f"dal trees: base {trees['base']}, this {trees['this']}; {rounds} alternating rounds (fresh processes) "
             f"x {reps} interleaved repetitions x {inner} calls; CPU ms per call (time.process_time), medians; "
             f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
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


def split(prefill: bool, reps: int) -> str:
    """The in-context cost of each kind of integer-model module (module doc), as a markdown table."""
    import collections

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import torch

    sys.path.insert(0, HERE)
    torch.set_num_threads(1)
    import llm_int_profile

    from dal.convert import api, attention, blocked_linear, layers, quant_calls, rmsnorm

    int_pre, int_dec, pre_in, dec_in, float_pre, float_dec, _ = llm_int_profile.models()
    model, inputs, fp = (int_pre, pre_in, float_pre) if prefill else (int_dec, dec_in, float_dec)
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the dal source tree to compare with (e.g. a `git worktree add` of the commit before)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--split", action="store_true", help="where this checkout's integer step spends its time")
    ap.add_argument("--prefill", action="store_true", help="--split: the prefill step (default: decode)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.split:
        split(a.prefill, a.reps)
    elif a.worker:
        worker(a.worker, a.reps, a.inner)
    else:
        if not a.base:
            ap.error("--base TREE is required")
        main(a.base, a.rounds, a.reps, a.inner)
