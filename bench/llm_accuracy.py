"""Held-out perplexity of the tiny Llama (bench/llm_common.py) under W4A8 quantization: float, RTN,
GPTQ, SparseGPT 2:4, QAT from RTN / from GPTQ, QAT 2:4 from SparseGPT, QAT with an FP8 KV cache; each row over
several seeds, with the share of the float-to-RTN perplexity gap it recovers, its time, and the
deployed perplexity (the integer model of dal.convert, bench/llm_deployed.py) on seed 0.
The setting is :data:`SETTING` (w4a8_int8_llm with int4 weights at one scale per tensor).

    python bench/llm_accuracy.py [--seeds 0 1 2] [--qat-steps 100] [--rows float rtn qat_rtn] [--write]

``--write`` merges the rows run into bench/results/llm_accuracy.json (the per-seed numbers; rows not
run keep their stored numbers), then writes the table from it to bench/results/llm_accuracy.md and
the README's LLM table (between the markers ``<!-- llm-accuracy-table -->``);
tests/test_readme_llm.py checks that the two agree.

What a seed fixes: the calibration batches (random windows of the training split) and, for QAT rows,
the order of the training windows. The float model is the one cached pre-trained model, the same for
every seed. Rows whose dal pieces are missing (dal.ptq.gptq, dal.ptq.sparsegpt, a ``kv_cache`` rule)
print "not available" with the reason.

Gap recovered = (ppl_RTN - ppl_row) / (ppl_RTN - ppl_float), from the seed means. Targets (issue 42):
QAT rows >= 60 %, GPTQ >= 40 %.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import time
import warnings

import torch

import llm_common as L  # bench/llm_common.py
from cpu import cpu_flags  # bench/cpu.py
from results_file import RESULTS, write_result  # bench/results_file.py

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MARK = ("<!-- llm-accuracy-table -->", "<!-- /llm-accuracy-table -->")
#: calibration: this many random [8, 128] windows of the training split
CALIB_BATCHES = 8
#: QAT: AdamW, peak lr a tenth of pre-training's, cosine, batch 8 x 128
QAT = dict(steps=100, lr=3e-4, warmup=10, batch=8, length=L.SEQ)
TARGETS = {"gptq": 0.40, "qat": 0.60}
#: deployed perplexity (issue 43 item 5): the integer model (dal.convert) of each quantized row on these
#: seeds, over this many held-out windows (None: all), the first ``npu_windows`` of them also run by
#: dal.npu on the exported prefill graph and compared logit for logit (bench/llm_deployed.py)
DEPLOYED = dict(seeds=[0], windows=48, npu_windows=1)
FP8 = {"format": "fp8_e4m3", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"}
INT8 = {"format": "int8", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"}


#: hardware models read once at start (a run takes an hour: a file edited meanwhile must not change it)
HARDWARE: dict = {}


class NotAvailable(Exception):
    """A row whose dal piece (GPTQ, SparseGPT, KV-cache quantizers) is not in this tree."""


#: the table's setting: ``w4a8_int8_llm`` made harder so that RTN loses a real share of perplexity
#: (issue 42 asks >= 5 %): int4 weights with ONE symmetric min-max scale per tensor in every Linear,
#: the embedding and lm_head included (the shipped recipe: one scale per group of 32, int8 per row for
#: the embedding and lm_head); int8 per-tensor static activations everywhere and the int8 per-tensor
#: KV cache as shipped. bench/results/llm_accuracy.md lists the other settings measured.
INT4_PER_TENSOR = {"format": "int4", "granularity": "per_tensor", "symmetric": True, "observer": "minmax"}
SETTING = ("recipes/w4a8_int8_llm.yaml with int4 weights at one scale per tensor (symmetric, min-max) in every "
           "Linear, the embedding and lm_head included; int8 per-tensor activations and KV cache as shipped")


#: why :data:`SETTING` (printed under the table)
WHY = ("Why this setting: under the shipped recipes RTN loses under 1% on this model, and so do the levers the "
       "issue names (group 128, per-tensor int8 activations; settings table below). What opens the gap is the "
       "resolution of the int4 weight scales, above all lm_head's: one scale per tensor in every Linear, the "
       "embedding and lm_head included, is the least exotic setting measured that comes near 5%, and what an "
       "int4 engine without per-channel scales runs. No setting a W4A8 "
       "NPU would ship reaches 5% on this model without pre-training a larger one (not done: 23 CPU minutes); "
       "fp8_e5m2 activations lose more, but no NPU quantizes activations to e5m2.")


def harder(recipe, weight: dict | None = None, heads: dict | None = None) -> dict:
    """``recipe`` (name or dict) with every int4 weight spec replaced by ``weight`` and the embedding's
    and lm_head's (``position: last``) weight spec by ``heads`` (each left as is when None)."""
    rec = recipe_doc(recipe)
    for rule in rec["rules"]:
        w = rule.get("weight")
        if weight is not None and isinstance(w, dict) and w.get("format") == "int4":
            rule["weight"] = dict(weight)
        if heads is not None and (rule.get("type") == "embedding" or
                                  (rule.get("type") == "linear" and rule.get("position") == "last")):
            rule["weight"] = dict(heads)
    return rec


def base_recipe() -> tuple[dict, str]:
    """(recipe, what): the table's setting (:data:`SETTING`), a bench-level variant of the shipped
    ``w4a8_int8_llm`` (checked by dal.recipe.load_recipe here, not in the middle of a run)."""
    from dal.recipe import load_recipe

    rec = harder("w4a8_int8_llm", INT4_PER_TENSOR, INT4_PER_TENSOR)
    rec["name"] = "w4a8_int8_llm_int4_per_tensor"
    load_recipe(rec)
    return rec, SETTING


def recipe_doc(recipe) -> dict:
    """A copy of ``recipe`` as a dict: a bundled name is read from recipes/<name>.yaml."""
    if isinstance(recipe, str):
        import yaml

        import dal

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(dal.__file__))), "recipes", f"{recipe}.yaml")
        with open(path) as fh:
            return yaml.safe_load(fh)
    return copy.deepcopy(recipe)


def with_weight(recipe, **spec) -> dict:
    """``recipe`` with every int4 weight spec's keys replaced by ``spec`` (granularity, group size)."""
    rec = recipe_doc(recipe)
    for rule in rec["rules"]:
        w = rule.get("weight")
        if isinstance(w, dict) and w.get("format") == "int4":
            rule["weight"] = {k: v for k, v in {**w, **spec}.items() if v is not None}
    return rec


def with_rule(recipe, **extra) -> dict:
    """``recipe`` (name or dict) as a dict with ``extra`` keys added to every int4 linear rule."""
    from dal.recipe import load_recipe

    rec = recipe_doc(recipe)
    for rule in rec["rules"]:
        w = rule.get("weight")
        if isinstance(w, dict) and w.get("format") == "int4" and "linear" in str(rule.get("type")) \
                and rule.get("position") != "last":  # lm_head keeps its own rule
            rule.update(extra)
    load_recipe(rec)  # refuse here, not in the middle of a run
    return rec


def kv_recipe(recipe) -> dict:
    """``recipe`` with its ``type: kv_cache`` rule replaced by one in fp8_e4m3 per tensor; NotAvailable when this
    tree's recipe schema or hardware model has no kv_cache op class."""
    import importlib.util

    from dal.recipe import load_recipe

    if importlib.util.find_spec("dal.nn.kv_cache") is None:
        raise NotAvailable("dal/nn/kv_cache.py is not in this tree")
    rec = copy.deepcopy(with_rule(recipe))
    rec["rules"] = [r for r in rec["rules"] if r.get("type") != "kv_cache"]  # the recipe's own (int8) cache rule
    rec["rules"].insert(0, {"type": "kv_cache", "input": dict(FP8)})
    # the KV quantizers live in dal's HF attention (dal.replace.hf_attention): without npu_attention the
    # kv_cache rule matches nothing
    rec["replace"] = sorted(set(rec.get("replace") or []) | {"npu_attention"})
    try:
        load_recipe(rec)
    except Exception as exc:  # noqa: BLE001
        raise NotAvailable(f"a kv_cache rule is refused: {str(exc).splitlines()[0]}") from exc
    return rec


def _ptq_step(name: str):
    import dal.ptq

    fn = getattr(dal.ptq, name, None)
    if fn is None:
        raise NotAvailable(f"dal.ptq.{name} is not in this tree")
    return fn


def _calib(seed: int):
    from dal_examples.datasets import text

    train_ids, _ = L.data()
    return list(text.random_batches(train_ids, 8, L.SEQ, CALIB_BATCHES, seed=10_000 + seed))


def _sparse_layers(recipe) -> list:
    """The paths of the layers that ``recipe`` with a ``sparsity: "2:4"`` rule on its int4 linears
    (:func:`with_rule`) makes 2:4 on the tiny Llama: every int4 Linear but lm_head."""
    import dal

    model, _ = L.pretrained(verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = dal.prepare_qat(model, recipe=with_rule(recipe, sparsity="2:4"), hardware=HARDWARE.get("a2000", "a2000"))
    names = [n for n, m in model.named_modules() if getattr(m, "weight_mask", None) is not None]
    _release(model)
    return names


def _prepared(recipe, seed: int, ptq: str | None = None, **ptq_args):
    """(model, seconds): the pre-trained tiny Llama prepared with ``recipe`` on the a2000, calibrated
    on :data:`CALIB_BATCHES` seeded windows, then ``dal.ptq.<ptq>(model, windows, **ptq_args)`` over
    the same windows."""
    import dal

    fn = _ptq_step(ptq) if ptq else None
    model, _ = L.pretrained(verbose=False)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = dal.prepare_qat(model, recipe=recipe, hardware=HARDWARE.get("a2000", "a2000"))
        if any(r.get("type") == "kv_cache" for r in recipe["rules"]) and not any(
                type(m).__name__ == "QKVCache" for m in model.modules()):
            raise NotAvailable("the kv_cache rule attached no KV-cache quantizer to this model")
        calib = _calib(seed)
        dal.calibrate(model, calib, progress=False, method="minmax")
        if fn is not None:
            fn(model, calib, **ptq_args)
    return model, time.perf_counter() - t


def _qat(model, seed: int) -> float:
    train_ids, _ = L.data()
    q = QAT
    return L.train(model, train_ids, q["steps"], q["batch"], q["length"], q["lr"], q["warmup"], 0.0, seed=seed)


def _release(model) -> None:
    """Drop a 2:4 controller's global optimizer hook so the next row's optimizer is not seen by it."""
    from dal.sparsity.controller import find_controller

    ctl = find_controller(model)
    if ctl is not None:
        ctl.remove()


def row_fns(recipe):
    """name -> (kind, fn(seed) -> (model, seconds)): every row of the table, in order."""
    # SparseGPT chooses the 2:4 masks itself, on the dense model (a sparsity rule would prune by magnitude
    # at prepare, and dal.ptq.sparsegpt refuses pruned layers): on the layers that the 2:4 rule of QAT 2:4
    # makes sparse (lm_head stays dense). Before QAT, the weights are SparseGPT's before rounding (latent):
    # the same fake-quant model, off the grid points, so the QAT moves codes as it does from RTN.
    sgpt = {}

    def sparsegpt_args(latent=False):
        if "layers" not in sgpt:
            sgpt["layers"] = _sparse_layers(recipe)
        return {"layers": sgpt["layers"], "latent": latent}

    def qat_from(rec_fn, ptq=None, args=dict):
        def run(seed):
            model, s = _prepared(rec_fn(), seed, ptq, **args())
            return model, s + _qat(model, seed)
        return run

    def pretrained_float(seed):
        model, info = L.pretrained(verbose=False)
        return model, info["seconds"]

    def float_more(seed):  # the QAT rows' extra steps, same seeds, no quantizer: their fair baseline
        model, _ = L.pretrained(verbose=False)
        return model, _qat(model, seed)

    return {
        "float": ("float", pretrained_float),
        "RTN W4A8": ("rtn", lambda seed: _prepared(recipe, seed)),
        "GPTQ W4A8": ("gptq", lambda seed: _prepared(recipe, seed, "gptq")),
        "SparseGPT 2:4 + W4A8": ("ptq", lambda seed: _prepared(recipe, seed, "sparsegpt", **sparsegpt_args())),
        "QAT W4A8 from RTN": ("qat", qat_from(lambda: recipe)),
        "QAT W4A8 from GPTQ": ("qat", qat_from(lambda: recipe, "gptq")),
        "QAT 2:4 + W4A8 from SparseGPT": ("qat", qat_from(lambda: recipe, "sparsegpt", lambda: sparsegpt_args(latent=True))),
        "QAT W4A8 + FP8 KV cache": ("qat", qat_from(lambda: kv_recipe(recipe))),
        "float + the QAT steps (baseline)": ("baseline", float_more),
    }


#: --rows ids -> table row names
IDS = {"float": "float", "rtn": "RTN W4A8", "gptq": "GPTQ W4A8", "sparsegpt": "SparseGPT 2:4 + W4A8",
       "qat_rtn": "QAT W4A8 from RTN", "qat_gptq": "QAT W4A8 from GPTQ", "qat_24": "QAT 2:4 + W4A8 from SparseGPT",
       "qat_kv": "QAT W4A8 + FP8 KV cache", "float_more": "float + the QAT steps (baseline)"}


def _e5m2(recipe) -> dict:
    """``recipe`` with every fp8_e4m3 activation (KV cache included) in fp8_e5m2."""
    rec = recipe_doc(recipe)
    for rule in rec["rules"]:
        if isinstance(rule.get("input"), dict) and rule["input"].get("format") == "fp8_e4m3":
            rule["input"] = {**rule["input"], "format": "fp8_e5m2"}
    return rec


def rtn_settings(recipe) -> dict:
    """label -> recipe: RTN under the shipped recipes, the settings the issue names to make the gap
    real (group 128, per-tensor INT8 activations), coarser weight scales, int4 embedding / lm_head,
    fp8_e5m2 activations, and the table's setting (``recipe``). Every one with its KV-cache rule."""
    i8, f8 = "w4a8_int8_llm", "w4a8_fp8_llm"
    pc = {**INT4_PER_TENSOR, "granularity": "per_channel"}
    g128 = {**INT4_PER_TENSOR, "granularity": "per_group", "group_size": 128}
    pt = INT4_PER_TENSOR
    head_only = harder(i8, pt)
    for rule in head_only["rules"]:
        if rule.get("type") == "linear" and rule.get("position") == "last":
            rule["weight"] = dict(pt)
    return {
        "w4a8_fp8_llm as shipped: int4 group 32, fp8_e4m3 activations and KV cache": recipe_doc(f8),
        "w4a8_int8_llm as shipped: int4 group 32, int8 per-tensor activations and KV cache": recipe_doc(i8),
        "int4 group 128, int8 activations": harder(i8, g128),
        "int4 per channel, int8 activations": harder(i8, pc),
        "int4 per channel, embedding and lm_head int4 per channel too, int8 activations": harder(i8, pc, pc),
        "int4 per tensor, embedding and lm_head int8 per row, int8 activations": harder(i8, pt),
        "int4 per tensor, lm_head int4 per tensor too, int8 activations": head_only,
        "int4 per tensor everywhere (embedding, lm_head), fp8_e4m3 activations": harder(f8, pt, pt),
        "int4 per tensor everywhere (embedding, lm_head), int8 activations (the table's)": recipe_doc(recipe),
        "int4 group 32, fp8_e5m2 activations and KV cache": _e5m2(f8),
        "int4 per tensor everywhere (embedding, lm_head), fp8_e5m2 activations": _e5m2(harder(f8, pt, pt)),
    }


def measure_settings(recipe, held, seed: int = 0) -> dict:
    """label -> {"ppl": held-out perplexity of RTN (prepare + calibrate) under that setting}."""
    out = {}
    for label, rec in rtn_settings(recipe).items():
        model, _ = _prepared(rec, seed)
        out[label] = {"ppl": L.perplexity(model, held), "seed": seed}
        print(f"  RTN {label}: ppl {out[label]['ppl']:.4f}", flush=True)
    return out


def _deployed(model, held, seed: int) -> dict:
    """bench/llm_deployed.deployed_perplexity of ``model`` under :data:`DEPLOYED`, with ``seed`` and
    its seconds; a failure is recorded (``error``), not raised: the row's other numbers stand."""
    from llm_deployed import deployed_perplexity  # bench/llm_deployed.py

    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = deployed_perplexity(model, held, DEPLOYED["windows"], DEPLOYED["npu_windows"])
        # the fake-quantized (QAT) model on the same windows: what the deployed number is compared with
        d["qat_model_ppl"] = L.perplexity(model, held[: d["windows"] * L.SEQ])
    except Exception as exc:  # noqa: BLE001 - reported in the table as a failure to look at
        d = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return {**d, "seed": seed, "seconds": time.perf_counter() - t}


def measure(rows: dict, seeds, held, save=None) -> dict:
    """name -> {"ppl": [per seed], "seconds": [per seed]} or {"na": reason}; ``save(row_dict)`` is
    called after each seed (so an interrupted run keeps the seeds it finished)."""
    out = {}
    for name, (kind, fn) in rows.items():
        ppl, secs, dep = [], [], []
        try:
            for seed in seeds:
                model, s = fn(seed)
                ppl.append(L.perplexity(model, held))
                secs.append(s)
                _release(model)
                print(f"  {name} seed {seed}: ppl {ppl[-1]:.4f}, {s:.0f} s", flush=True)
                if kind not in ("float", "baseline") and seed in DEPLOYED["seeds"]:
                    dep.append(_deployed(model, held, seed))
                    print(f"  {name} seed {seed}: deployed {dep[-1]}", flush=True)
                out[name] = {"kind": kind, "ppl": list(ppl), "seconds": list(secs), "seeds": list(seeds)[:len(ppl)],
                             "qat_steps": QAT["steps"] if kind in ("qat", "baseline") else 0}
                if dep:
                    out[name]["deployed"] = list(dep)
                if save is not None and len(ppl) < len(seeds):  # an interrupted run keeps the seeds it finished
                    save({name: out[name]})
                if kind == "float":  # one pre-trained model: every seed would score the same
                    break
        except NotAvailable as exc:
            out[name] = {"kind": kind, "na": str(exc)}
            print(f"  {name}: not available ({exc})", flush=True)
        if save is not None:
            save({name: out[name]})
    return out


def merge(results: dict, path: str) -> dict:
    """The rows stored in ``path`` (JSON, the raw per-seed numbers behind the table) updated with
    ``results``; written back to ``path``. A row keeps its last measured numbers until re-run."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "dal_llm_accuracy.lock"), "w") as lock:  # two runs of different rows may finish together
        fcntl.flock(lock, fcntl.LOCK_EX)
        stored = {}
        if os.path.exists(path):
            with open(path) as fh:
                stored = json.load(fh)
        stored.update(results)
        with open(path, "w") as fh:
            json.dump(stored, fh, indent=1, sort_keys=True)
            fh.write("\n")
    return stored


def deployed_only(rows: dict, held, path: str | None) -> None:
    """For each quantized row of ``rows``: rebuild its models of :data:`DEPLOYED` seeds, measure
    their deployed perplexity and store it in the row's ``deployed`` list in ``path`` (JSON; entries
    of other seeds and the row's stored perplexities stay; with ``path`` None only printed)."""
    import fcntl
    import tempfile

    for name, (kind, fn) in rows.items():
        if kind in ("float", "baseline"):
            continue
        dep = []
        for seed in DEPLOYED["seeds"]:
            model, _ = fn(seed)
            _release(model)
            dep.append(_deployed(model, held, seed))
            print(f"  {name} seed {seed}: deployed {dep[-1]}", flush=True)
        if path is None:
            continue
        with open(os.path.join(tempfile.gettempdir(), "dal_llm_accuracy.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with open(path) as fh:
                stored = json.load(fh)
            if name in stored and "ppl" in stored[name]:  # the seeds measured now replace their stored entries
                kept = [d for d in stored[name].get("deployed") or [] if d.get("seed") not in DEPLOYED["seeds"]]
                stored[name]["deployed"] = sorted(kept + dep, key=lambda d: d["seed"])
            with open(path, "w") as fh:
                json.dump(stored, fh, indent=1, sort_keys=True)
                fh.write("\n")


def table(results: dict, what: str) -> str:
    """The markdown table (and its header lines) of :func:`measure`'s results: one line per row of
    :data:`IDS` (``not available`` for rows without numbers, the reason listed below the table)."""
    mean = {k: statistics.mean(v["ppl"]) for k, v in results.items() if k in IDS.values() and "ppl" in v}
    f, r = mean.get("float"), mean.get("RTN W4A8")
    lines = [f"Tiny Llama ({L.CONFIG['num_hidden_layers']} layers, width {L.CONFIG['hidden_size']}, byte tokens), "
             f"held-out perplexity (bytes) on the last pydoc_data.topics topics; recipe: {what}; a2000; "
             f"calibration {CALIB_BATCHES} windows of 8x{L.SEQ}; QAT batch {QAT['batch']}x{QAT['length']}, "
             f"AdamW lr {QAT['lr']} cosine. A seed fixes the calibration windows and the QAT data order; "
             f"time is calibration + PTQ + QAT (float: its pre-training), 1 torch thread on a shared machine.", "",
             "| row | perplexity (mean) | min - max over seeds | seeds | QAT steps | gap recovered | target "
             "| minus baseline, paired by seed | time (s) | deployed perplexity (integer model) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = results.get("float + the QAT steps (baseline)", {})
    reasons = []
    for name in IDS.values():
        v = results.get(name) or {"na": "not run yet"}
        if "na" in v:
            lines.append(f"| {name} | not available | - | - | - | - | - | - | - | - |")
            reasons.append(f"{name}: {v['na']}")
            continue
        m = mean[name]
        spread = "(one model)" if v["kind"] == "float" else f"{min(v['ppl']):.4f} - {max(v['ppl']):.4f}"
        gap = "-" if v["kind"] in ("float", "rtn") or f is None or r is None or r == f else (r - m) / (r - f)
        target = TARGETS.get(v["kind"])
        verdict = "-" if target is None or gap == "-" else f"{'ok' if gap >= target else 'MISSED'} (>= {target:.0%})"
        gap_s = gap if gap == "-" else f"{gap:.0%}"
        seeds = ", ".join(str(x) for x in v["seeds"])
        steps = v.get("qat_steps") or "-"
        paired = "-"
        if v["kind"] == "qat" and "ppl" in base:
            by_seed = dict(zip(base["seeds"], base["ppl"]))
            diffs = [p - by_seed[sd] for sd, p in zip(v["seeds"], v["ppl"]) if sd in by_seed]
            paired = f"{statistics.mean(diffs):+.4f}" if diffs else "-"
        lines.append(f"| {name} | {m:.4f} | {spread} | {seeds} | {steps} | {gap_s} | {verdict} | {paired} | "
                     f"{statistics.mean(v['seconds']):.0f} | {_deployed_cell(v)} |")
    verdicts = []
    for name in IDS.values():
        v = results.get(name) or {}
        target = TARGETS.get(v.get("kind"))
        if target is None or "ppl" not in v or f is None or r is None or r == f:
            continue
        gap = (r - mean[name]) / (r - f)
        verdicts.append(f"{name} {'meets' if gap >= target else 'MISSES'} its target ({gap:.0%} of the gap, "
                        f">= {target:.0%} asked; spread over seeds {max(v['ppl']) - min(v['ppl']):.4f}, "
                        f"{(max(v['ppl']) - min(v['ppl'])) / (r - f):.0%} of the gap)")
    if verdicts:
        lines += ["", "Targets (issue 42: QAT >= 60% of the gap, GPTQ >= 40%): " + "; ".join(verdicts) + "."]
    if f is not None and r is not None:
        lines += ["", f"RTN loses {100 * (r / f - 1):.2f}% perplexity against float (a gap of {r - f:.4f}); "
                  f"the issue asks for at least 5% so that the gap is real{'' if r >= 1.05 * f else ': NOT met'} "
                  f"(RTN under harder settings below).", "", WHY]
    spreads = [max(v["ppl"]) - min(v["ppl"]) for k, v in results.items()
               if k in IDS.values() and v.get("kind") in ("qat", "baseline") and "ppl" in v]
    if spreads and f is not None and r is not None and max(spreads) > r - f:
        lines += ["", f"The QAT rows' spread over seeds (up to {max(spreads):.4f}) exceeds the RTN gap ({r - f:.4f}): "
                  "their gap-recovered shares are dominated by the data order of the extra training steps. "
                  "The baseline row trains the float model for the same steps with the same seeds: compare "
                  "each QAT row with it, seed by seed (bench/results/llm_accuracy.json)."]
    if "ppl" in results.get("QAT W4A8 + FP8 KV cache", {}):
        lines += ["", "Every row's attention is the NPU's (`replace: [npu_attention]`: Q @ K^T and P @ V with int8 "
                  "inputs, softmax in fp16) with the recipe's int8 per-tensor KV cache; QAT W4A8 + FP8 KV cache "
                  "replaces that `kv_cache` rule with fp8_e4m3 per tensor."]
    lines += _sparse_lines(results, f, r)
    lines += _deployed_lines(results)
    if reasons:
        lines += ["", "Not available: " + "; ".join(reasons) + "."]
    settings = results.get("_rtn_settings")
    if settings and f is not None:
        lines += ["", "RTN (prepare + calibrate, seed 0) under the shipped recipes, the settings the issue names "
                  "to make the gap larger, and coarser ones (every one with the recipe's KV-cache rule):", "",
                  "| RTN setting | perplexity | loss vs float |", "|---|---|---|"]
        lines += [f"| {k} | {v['ppl']:.4f} | {100 * (v['ppl'] / f - 1):.2f}% |"
                  for k, v in sorted(settings.items(), key=lambda kv: kv[1]["ppl"])]
    return "\n".join(lines) + "\n"


#: the key under which bench/results/llm_accuracy.json keeps the QAT 2:4 row of the earlier flow
#: (magnitude masks at prepare, then the same QAT), measured before the row started from SparseGPT
MAGNITUDE_24 = "QAT 2:4 + W4A8"


def _sparse_lines(results: dict, f, r) -> list:
    """The note under the table on the 2:4 rows: how SparseGPT and the QAT after it are run, and the
    stored numbers of the earlier flow (:data:`MAGNITUDE_24`) when the json still holds them."""
    if "ppl" not in results.get(IDS["qat_24"], {}):
        return []
    line = ("2:4 rows: dal.ptq.sparsegpt chooses the 2:4 masks on the dense prepared model (every int4 Linear but "
            "lm_head; a recipe sparsity rule would prune by magnitude at prepare, and SparseGPT then only re-chose "
            "among magnitude's survivors), jointly with the int4 weights, on the calibration windows. QAT 2:4 + W4A8 "
            "from SparseGPT keeps those masks through the QAT steps and starts from SparseGPT's weights before "
            "rounding (`latent=True`: the same fake-quant model, but weights off the grid points, so the QAT moves "
            "codes as it does from RTN).")
    old = results.get(MAGNITUDE_24) or {}
    if "ppl" in old and f is not None and r is not None and r != f:
        m = statistics.mean(old["ppl"])
        line += (f" The earlier flow, magnitude 2:4 masks at prepare then the same {old.get('qat_steps')} QAT steps: "
                 f"{m:.4f} (seeds {', '.join(str(x) for x in old['seeds'])}: {min(old['ppl']):.4f} - "
                 f"{max(old['ppl']):.4f}), {(r - m) / (r - f):.0%} of the gap.")
    return ["", line]


def _deployed_cell(v: dict) -> str:
    """The deployed-perplexity cell: the integer model's perplexity (mean over its seeds, the seeds
    named), ``FAILED`` when dal.convert / the export failed, ``-`` when not measured."""
    dep = v.get("deployed") or []
    if not dep:
        return "-"
    if any("error" in d for d in dep):
        return "FAILED (below)"
    ppl, fq = [d["ppl"] for d in dep], [d["qat_model_ppl"] for d in dep]
    where = "all windows" if all(d["windows"] == d["of"] for d in dep) else f"first {dep[0]['windows']} windows"
    return (f"{statistics.mean(ppl):.4f} (fake-quant model {statistics.mean(fq):.4f}; {where}; "
            f"seed{'s' if len(ppl) > 1 else ''} {', '.join(str(d['seed']) for d in dep)})")


def _deployed_lines(results: dict) -> list:
    """The lines under the table about the deployed column: windows scored, the integer model vs
    dal.npu count (positions, logits, how many differ), failures named."""
    deps = [(k, d) for k, v in results.items() if k in IDS.values() for d in v.get("deployed") or []]
    ok = [d for _, d in deps if "error" not in d]
    if not deps:
        return []
    lines = [""]
    if ok:
        windows = sorted({d["windows"] for d in ok})
        pos = sum(d["npu_positions"] for d in ok)
        logits = sum(d["npu_logits"] for d in ok)
        differ = sum(d["npu_differ"] for d in ok)
        nw = sorted({d["npu_windows"] for d in ok})
        lines.append(
            f"Deployed perplexity: the integer model (`dal.convert` of the prefill step that `dal.export_decoder` "
            f"exports, prompt_len = cache_len = {L.SEQ}, every position valid) scores the held-out set "
            f"({'/'.join(str(w) for w in windows)} of the {ok[0]['of']} windows of {L.SEQ} tokens that the "
            f"perplexity column scores; the cell gives the fake-quantized model's perplexity on the same windows "
            f"next to it) for {len(ok)} quantized row x seed model(s). On the first "
            f"{'/'.join(str(w) for w in nw)} window(s) of each, dal.npu ran the exported prefill graph: "
            f"{pos} positions compared, {differ} of {logits} logits differ from the integer model's "
            f"(bit for bit){'' if differ == 0 else ': A BUG, to be reported'}.")
    for k, d in deps:
        if "error" in d:
            lines.append(f"Deployed perplexity of {k} (seed {d['seed']}) FAILED: {d['error']}")
    return lines


def write_readme(md: str) -> None:
    """Replace the README's text between :data:`MARK` with ``md`` (the table lines only)."""
    with open(README) as fh:
        text = fh.read()
    pattern = re.escape(MARK[0]) + r"\n.*?" + re.escape(MARK[1])
    if not re.search(pattern, text, flags=re.S):
        raise SystemExit(f"README.md has no {MARK[0]} ... {MARK[1]} block: add one under the LLM section")
    text = re.sub(pattern, lambda _: f"{MARK[0]}\n{md.strip()}\n{MARK[1]}", text, flags=re.S)
    with open(README, "w") as fh:
        fh.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--qat-steps", type=int, default=QAT["steps"])
    ap.add_argument("--rows", nargs="*", default=list(IDS), choices=list(IDS),
                    help="the rows to run (default all; none: only re-write the table from the stored rows)")
    ap.add_argument("--settings", action="store_true", help="also RTN under harder settings (group 128, int8, ...)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--deployed-only", action="store_true",
                    help="only the deployed perplexity of --rows (their models rebuilt), stored into their rows")
    ap.add_argument("--deployed-seeds", type=int, nargs="*", default=DEPLOYED["seeds"],
                    help="seeds whose quantized rows also get the deployed (integer model) perplexity")
    ap.add_argument("--deployed-windows", type=int, default=DEPLOYED["windows"],
                    help="held-out windows the integer model scores (default: all)")
    ap.add_argument("--npu-windows", type=int, default=DEPLOYED["npu_windows"],
                    help="of those, how many dal.npu also runs (exported prefill graph), compared logit for logit")
    ap.add_argument("--write", action="store_true", help="write bench/results/llm_accuracy.md and the README table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    QAT["steps"] = args.qat_steps
    DEPLOYED.update(seeds=args.deployed_seeds, windows=args.deployed_windows, npu_windows=args.npu_windows)
    from dal.hardware import load_hardware

    HARDWARE["a2000"] = load_hardware("a2000")
    recipe, what = base_recipe()
    recipe = recipe_doc(recipe)  # read once, as the hardware model
    rows = row_fns(recipe)
    rows = {IDS[i]: rows[IDS[i]] for i in IDS if i in args.rows}
    print(f"CPU: {cpu_flags()}; {torch.get_num_threads()} torch threads; recipe: {what}", flush=True)
    _, held = L.data()
    store = os.path.join(RESULTS, "llm_accuracy.json")
    if args.deployed_only:
        deployed_only(rows, held, store if args.write else None)
        rows = {}
    results = measure(rows, args.seeds, held, save=(lambda r: merge(r, store)) if args.write else None)
    if args.settings:
        results["_rtn_settings"] = measure_settings(recipe, held)
    if args.write:
        results = merge(results, store)
    md = table(results, what)
    print(md)
    if args.write:
        write_result("llm_accuracy.md", md)
        write_readme(md)


if __name__ == "__main__":
    sys.exit(main())
