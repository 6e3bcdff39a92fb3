"""One training step of the tiny Llama (bench/llm_common.py; batch 8, sequence 128, AdamW):
float vs dal W4A8 QAT (recipes/w4a8_fp8_llm.yaml) vs torchao's QAT with its int8 dynamic
activation, int4 group weight configuration, eager and ``torch.compile``-d, in one interleaved run.

Peer: ``torchao.quantization.quantize_(model, QATConfig(Int8DynamicActivationIntxWeightConfig(
weight_dtype=torch.int4, weight_granularity=PerGroup(32)), step="prepare"))``: every Linear (lm_head
included) fake-quantizes its input per token (int8, asymmetric, dynamic) and its weight per group
of 32 (int4, symmetric). dal's W4A8 QAT: int4 per-group-32 weights, static per-tensor fp8 / int8
activations, int8 embedding and lm_head (the recipe's rules).

Each repetition runs every candidate once, in turn (float, dal, torchao, then the compiled three);
the medians of wall time and of this process's CPU time (``time.process_time``: on a shared machine
the wall clock also counts waiting for a core) are printed with the ratios, the CPU flags and the
load average. The compiled models' first (warm-up) step includes the compile and is not timed.

    python bench/llm_qat.py [--reps 7] [--threads 1] [--no-compile] [--no-floor] [--write]

Two eager floor rows (``--no-floor`` leaves them out) say what the eager target is measured against:
``float (eager attention) eager`` (the float model with transformers' explicit matmul + softmax attention,
the form the NPU attention has, instead of the fused SDPA kernel) and ``one pass per quantizer eager``
(dal's prepared model with every quantizer in QAT replaced by ``x * 1.0``: one elementwise pass
forward and one backward per quantizer site, the least any per-site fake quantization costs).

Targets (issue 42): dal / float <= 1.2 eager and <= 1.1 compiled; dal / torchao <= 1.0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

import llm_common as L  # bench/llm_common.py
from cpu import cpu_flags  # bench/cpu.py
from results_file import write_result  # bench/results_file.py

BATCH, SEQ = 8, 128
TARGETS = {"eager": 1.2, "compiled": 1.1, "peer": 1.0}


def step_fn(model, x):
    """A closure running one AdamW step of ``model`` on ``x`` (next-token loss, labels = x)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()
        opt.step()
    return step


def dal_model(x):
    """The tiny Llama prepared with w4a8_fp8_llm on the a2000, calibrated on ``x``, in train mode."""
    import dal

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = dal.prepare_qat(L.build(0), recipe="w4a8_fp8_llm", hardware="a2000")
        dal.calibrate(model, [x], progress=False)
    return model.train()


def torchao_model():
    """The tiny Llama under torchao's QAT prepare step, int8 dynamic per-token activations and
    int4 per-group-32 symmetric weights on every Linear."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_
    from torchao.quantization.qat import QATConfig

    model = L.build(0)
    base = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, QATConfig(base, step="prepare"))
    return model.train()


def float_eager_attention():
    """The float tiny Llama with transformers' eager attention (explicit matmul, softmax, matmul)."""
    model = L.build(0)
    model.config._attn_implementation = "eager"
    return model.train()


def one_pass_model(x):
    """:func:`dal_model` with every quantizer in QAT (state ``quantize``) computing ``t * 1.0`` instead:
    one elementwise pass forward and one backward per quantizer site (the floor row)."""
    from dal.quantizer import quantizers

    model = dal_model(x)
    for _, q in quantizers(model):
        if q.state == "quantize":
            q.forward = lambda t: t * 1.0
    return model


def candidates(x, compile_: bool, floor: bool = True) -> dict:
    """name -> step closure: float, dal, torchao eager, (``floor``) the two floor rows eager, and
    (``compile_``) float, dal, torchao compiled."""
    models = {"float": L.build(0).train(), "dal W4A8 QAT": dal_model(x), "torchao QAT": torchao_model()}
    if floor:
        models.update({"float (eager attention)": float_eager_attention(), "one pass per quantizer": one_pass_model(x)})
    runs = {f"{k} eager": step_fn(m, x) for k, m in models.items()}
    if compile_:
        for k in ("float", "dal W4A8 QAT", "torchao QAT"):  # separate instances: compile must not share modules
            m = {"float": lambda: L.build(0).train(), "dal W4A8 QAT": lambda: dal_model(x),
                 "torchao QAT": torchao_model}[k]()
            runs[f"{k} compiled"] = step_fn(torch.compile(m), x)
    return runs


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run(reps: int, compile_: bool, floor: bool = True) -> str:
    """The markdown report: CPU line, one row per candidate, the ratios against their targets."""
    torch.manual_seed(0)
    x = torch.randint(0, L.CONFIG["vocab_size"], (BATCH, SEQ))
    runs = candidates(x, compile_, floor)
    t = time.perf_counter()
    for fn in runs.values():  # warm-up: compiles, allocator, AdamW state
        fn()
    warm = time.perf_counter() - t
    before = _load()
    wall, cpu = {k: [] for k in runs}, {k: [] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(1e3 * (time.perf_counter() - t))
            cpu[k].append(1e3 * (time.process_time() - c))
    after = _load()
    wall = {k: statistics.median(v) for k, v in wall.items()}
    cpu = {k: statistics.median(v) for k, v in cpu.items()}
    lines = [f"CPU: {cpu_flags()}; {torch.get_num_threads()} torch threads; {os.cpu_count()} cores; torch {torch.__version__}",
             "", f"Tiny Llama ({L.CONFIG['num_hidden_layers']} layers, width {L.CONFIG['hidden_size']}, vocab "
             f"{L.CONFIG['vocab_size']}) train step (AdamW), batch {BATCH} x {SEQ} tokens, medians of {reps} "
             f"interleaved repetitions (wall and this process's CPU time of the same steps); warm-up "
             f"(compiles included) {warm:.0f} s; load average {before} -> {after}.", "",
             "| step | wall (ms) | CPU (ms) | / float (wall) | / float (CPU) |", "|---|---|---|---|---|"]
    for k in runs:
        mode = k.rsplit(" ", 1)[1]
        fw, fc = wall[f"float {mode}"], cpu[f"float {mode}"]
        lines.append(f"| {k} | {wall[k]:.0f} | {cpu[k]:.0f} | {wall[k] / fw:.3f} | {cpu[k] / fc:.3f} |")
    lines += ["", "| check | wall | CPU | target | verdict (CPU) |", "|---|---|---|---|---|"]
    checks = [("dal / float, eager", "dal W4A8 QAT eager", "float eager", TARGETS["eager"]),
              ("dal / torchao, eager", "dal W4A8 QAT eager", "torchao QAT eager", TARGETS["peer"])]
    if compile_:
        checks += [("dal / float, compiled", "dal W4A8 QAT compiled", "float compiled", TARGETS["compiled"]),
                   ("dal / torchao, compiled", "dal W4A8 QAT compiled", "torchao QAT compiled", TARGETS["peer"])]
    if floor:
        checks += [("floor: float eager attention / float, eager", "float (eager attention) eager", "float eager",
                    None),
                   ("floor: one pass per quantizer / float, eager", "one pass per quantizer eager", "float eager",
                    None),
                   ("dal / one pass per quantizer, eager", "dal W4A8 QAT eager", "one pass per quantizer eager",
                    None)]
    for name, a, b, target in checks:
        if target is None:
            lines.append(f"| {name} | {wall[a] / wall[b]:.3f} | {cpu[a] / cpu[b]:.3f} | - | - |")
            continue
        r_w, r_c = wall[a] / wall[b], cpu[a] / cpu[b]
        lines.append(f"| {name} | {r_w:.3f} | {r_c:.3f} | <= {target} | {'ok' if r_c <= target else 'MISSED'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--no-floor", action="store_true", help="without the two eager floor rows")
    ap.add_argument("--write", action="store_true", help="write bench/results/llm_qat.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    md = run(args.reps, not args.no_compile, not args.no_floor)
    print(md)
    if args.write:
        write_result("llm_qat.md", md)


if __name__ == "__main__":
    main()
