"""The multi-camera BEV example (examples/bev) on the deployed numbers: occupancy mIoU and
digit-class accuracy of float, PTQ INT8, QAT INT8 (int8_balanced: the grid_sample's grid int16
at 2^-14, its output on its input's scale) and QAT W4A8 (w4a8_fp8_performance), each scored from
the torch model and from dal.npu running the exported file, with the same post-processing
(argmax per cell, ``bev_model.bev_metrics``). Then, interleaved in the same run, the training
step QAT INT8 vs float (target <= 1.25x, CPU time of this process) and the exported QAT model
on dal.npu vs onnxruntime.

Protocol (the float row is the fair baseline: same total steps as every QAT row):
  1. float: F Adam steps (cosine lr), shared by every row;
  2. "float" row: Q more float steps at the fine-tune learning rate (F + Q in all);
     PTQ INT8 is that model calibrated (no training);
  3. QAT rows: the F-step model, prepared, calibrated, then Q QAT steps at the same learning rate.

    python bench/bev.py --write                   # writes bench/results/bev.md
    python bench/bev.py --model splat --write     # Lift-Splat variant: bench/results/bev_splat.md
    python bench/bev.py --model deform --write    # + MSDA, and an FP16-deformable row: bev_deform.md
    python bench/bev.py --quick                   # smoke run, numbers not meaningful
    python bench/bev.py --model deform --speed-only --write   # the speed section alone (a shorter
                                                  # float pre-training, no accuracy rows): rewrites
                                                  # the speed part of bev_deform.md, keeps its tables

``--model deform`` also times the deformable block alone (examples/bev/bev_deform.py's
``MSDeformAttn`` on the inputs the model gives it): the QAT block's forward (calibrated, quantizers
frozen, and quantizing while observing as in a QAT step) against the float block's, interleaved,
CPU time (target <= 1.5x); forward + backward beside it.

``--model splat`` trains ``bev_splat.LiftSplatBEV`` (flat-ground lift, scatter-add BEV pooling) with
each recipe plus a rule quantizing ``scatter_add`` like its other activations (no bundled recipe
lists the op class yet): the sum exact on the integer codes, then requantized (SPEC §5c).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "bev"))

import dal  # noqa: E402
from bev_model import GridSampleBEV  # noqa: E402
from bev_deform import DeformBEV  # noqa: E402
from bev_splat import LiftSplatBEV  # noqa: E402
from bev_scenes import CAMERAS, CELLS, IMAGE, bev_scenes  # noqa: E402
from cpu import cpu_flags  # noqa: E402  (bench/cpu.py)
from results_file import write_result  # noqa: E402
from timing import interleaved_times  # noqa: E402
from train_bev import batches, evaluate, npu_runner, torch_runner, train_steps  # noqa: E402

ROWS = [("PTQ INT8", "int8_balanced", False), ("QAT INT8", "int8_balanced", True),
        ("QAT W4A8", "w4a8_fp8_performance", True)]
LIMITS = {"QAT INT8": 0.5, "QAT W4A8": 2.0}
BATCH, LR = 16, 2e-3
MODELS = {"grid": GridSampleBEV, "splat": LiftSplatBEV, "deform": DeformBEV}
#: the deformable model's extra row: MSDA's sampling arithmetic, weighted sum and grid_samples in FP16
EXTRA_ROWS = {"deform": [("QAT FP16-deformable", "int8_deform_fp16", True)]}
DESCRIBE = {"grid": "GridSampleBEV (grid_sample at fixed reference points, mean over the cameras that see a cell)",
            "splat": "LiftSplatBEV (each feature pixel lifted to its ground point, index_add into its cell, "
                     "divided by the cell's pixel count)",
            "deform": "DeformBEV (GridSampleBEV's BEV as queries, then Deformable-DETR's MSDeformAttn in plain PyTorch "
                      "over the 4 cameras as levels, 2 heads x 2 points, added to the queries)"}


def recipe_for(name: str, model: str):
    """The bundled recipe ``name``; for ``splat``, where no rule of it lists ``scatter_add``, a dict
    whose last rule (the activations' op classes) also lists it."""
    if model != "splat":
        return name
    import yaml

    with open(os.path.join(ROOT, "recipes", f"{name}.yaml")) as f:
        rec = yaml.safe_load(f)
    types = lambda r: [r["type"]] if isinstance(r.get("type"), str) else list(r.get("type") or [])  # noqa: E731
    if any("scatter_add" in types(r) for r in rec["rules"]):
        return name
    rec["rules"][-1]["type"] = types(rec["rules"][-1]) + ["scatter_add"]
    rec["name"] = f"{name}+scatter_add"
    return rec


def quantized(float_model, recipe, train, test, qat_steps):
    """prepare_qat + calibrate (16 batches) (+ QAT steps at LR / 4); returns (model, CPU seconds)."""
    c0 = time.process_time()
    model = dal.prepare_qat(copy.deepcopy(float_model), recipe=recipe, hardware="a2000",
                            example_inputs=(test.images[:2],))
    dal.calibrate(model, [train.images[i:i + BATCH] for i in range(0, min(16 * BATCH, len(train)), BATCH)], progress=False)
    if qat_steps:
        train_steps(model, train, qat_steps, lr=LR / 4, batch_size=BATCH, seed=1)
    dal.set_quantizer_state(model, "frozen")
    return model, time.process_time() - c0


def export(model, example, workdir, label):
    path = os.path.join(workdir, label.replace(" ", "_") + ".onnx")
    model.eval()
    dal.export_onnx(model, (example,), path, dynamic_batch=True)
    return path


def accuracy_rows(train, test, fs, qs, workdir, model="grid"):
    """[(label, torch scores, npu scores or None, train CPU s)], the QAT INT8 model and its file."""
    torch.manual_seed(0)
    net = MODELS[model]()
    c0 = time.process_time()
    train_steps(net, train, fs, lr=LR, batch_size=BATCH)
    t_float = time.process_time() - c0
    fair = copy.deepcopy(net)
    c0 = time.process_time()
    train_steps(fair, train, qs, lr=LR / 4, batch_size=BATCH, seed=1)
    t_fair = t_float + time.process_time() - c0
    rows = [(f"float ({fs} + {qs} steps)", evaluate(torch_runner(fair), test), None, t_fair)]
    print(f"{rows[0][0]}: {rows[0][1]}", file=sys.stderr, flush=True)
    keep = {}
    for label, recipe, trains in ROWS + EXTRA_ROWS.get(model, []):
        rec = recipe_for(recipe, model)
        qm, secs = quantized(net if trains else fair, rec, train, test, qs if trains else 0)
        scores = evaluate(torch_runner(qm), test)
        path = export(qm, test.images[:2], workdir, label)
        npu = evaluate(npu_runner(path), test)
        name = recipe if isinstance(rec, str) else rec["name"]
        rows.append((f"{label} ({name})", scores, npu, secs + (t_float if trains else t_fair)))
        print(f"{rows[-1][0]}: torch {scores} npu {npu}", file=sys.stderr, flush=True)
        keep[label] = (qm, path)
    return rows, fair, keep["QAT INT8"]


def table(rows):
    lines = ["| model | occupancy mIoU torch | mIoU NPU | digit-class acc. torch | acc. NPU | train CPU (s) |",
             "|---|---|---|---|---|---|"]
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for label, t, n, secs in rows:
        lines.append(f"| {label} | {f(t['miou'])} | {f(n['miou'] if n else None)} | {f(t['class_acc'])} | "
                     f"{f(n['class_acc'] if n else None)} | {secs:.0f} |")
    return lines


def checks(rows):
    out = []
    base = rows[0][1]["miou"]
    for label, t, n, _ in rows[1:]:
        d = max(abs(t[k] - n[k]) for k in ("miou", "class_acc"))
        out.append(f"{label}: NPU vs torch, largest difference {d:.3f} points ({'ok' if d <= 0.1 else 'FAIL'}, "
                   "target <= 0.1)")
    for label, t, _, _ in rows[1:]:
        key = label.split(" (")[0]
        if key in LIMITS:
            gap = base - t["miou"]
            out.append(f"{key}: occupancy mIoU {gap:+.2f} points below float ({'ok' if gap <= LIMITS[key] else 'FAIL'}, "
                       f"target <= {LIMITS[key]})")
    return out


def _step_fn(model, images, targets):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()

    def step():
        loss = F.cross_entropy(model(images), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def _median_ms(xs):
    return statistics.median(xs)


def _block_inputs(model, images):
    """The arguments ``model.attn`` (the MSDA block) gets in ``model(images)`` (strides kept, detached)."""
    seen = {}
    hook = model.attn.register_forward_pre_hook(lambda m, args: seen.setdefault("args", args))
    with torch.no_grad():
        model.eval()(images)
    hook.remove()
    return [a.detach() for a in seen["args"]]


def block_section(fair, qat, images, reps):
    """The deformable block alone: float ``fair.attn`` vs the QAT ``qat.attn`` (calibrated), its
    quantizers frozen and quantizing while observing (the QAT step's state), train mode, autograd
    on as in training; forward, and forward + backward; interleaved CPU time."""
    args = _block_inputs(copy.deepcopy(fair), images)
    query, ref, value, shapes = args
    blocks = {"float": copy.deepcopy(fair.attn)}
    for label, state in (("QAT frozen", "frozen"), ("QAT observing", "quantize")):
        blocks[label] = dal.set_quantizer_state(copy.deepcopy(qat.attn), state)
    for b in blocks.values():
        b.train()

    def fwd(b, backward):
        def run():
            q, v = query.clone(memory_format=torch.preserve_format).requires_grad_(), value.clone().requires_grad_()
            out = b(q, ref, v, shapes)
            if backward:
                out.sum().backward()
        return run
    runs = {f"{k} {w}": fwd(b, w == "fwd+bwd") for k, b in blocks.items() for w in ("fwd", "fwd+bwd")}
    t = interleaved_times(runs, reps, clock=time.process_time, warmup=True)
    med = {k: _median_ms(v) for k, v in t.items()}
    lines = [f"The deformable block alone (`MSDeformAttn`, {CELLS * CELLS} queries x batch {BATCH}, {CAMERAS} levels "
             f"{IMAGE // 2}x{IMAGE // 2}, 2 heads x 2 points, d_model 32; its inputs from the model), train mode, "
             f"autograd on, CPU time, medians of {reps} interleaved rounds:", "",
             "| block | forward (ms) | forward / float | forward + backward (ms) | / float |", "|---|---|---|---|---|"]
    for k in blocks:
        lines.append(f"| {k} | {med[k + ' fwd']:.2f} | {med[k + ' fwd'] / med['float fwd']:.2f}x | "
                     f"{med[k + ' fwd+bwd']:.2f} | {med[k + ' fwd+bwd'] / med['float fwd+bwd']:.2f}x |")
    worst = max(med[k + " fwd"] / med["float fwd"] for k in blocks if k != "float")
    lines += ["", f"QAT block forward / float, the slower state: {worst:.2f}x "
              f"({'ok' if worst <= 1.5 else 'MISSED'}, target <= 1.5x).", ""]
    return lines + quantizer_floor(blocks["QAT observing"], (query, ref, value, shapes), med["float fwd"], reps)


def quantizer_floor(block, args, float_fwd, reps, top=6):
    """Where the observing block's extra time goes: each quantizer call of one forward, timed alone
    on the tensor it got (its strides and ``requires_grad`` as in the forward, train mode, autograd
    on), against its floor ``x * c`` (one pass over the same tensor), interleaved CPU time; and the
    same calls timed in context (forward pre / post hooks over ``reps`` forwards of the block)."""
    from dal.nn.grid_sample import SharedRequant
    from dal.quantizer import FakeQuantizer

    mods, got = dict(block.named_modules()), {}
    quantizers = [n for n, m in mods.items() if isinstance(m, (FakeQuantizer, SharedRequant))]

    def keep(name):
        def hook(module, args):  # returns None: the call's arguments unchanged
            got.setdefault(name, (args[0].detach(), args[0].requires_grad))
        return hook
    hooks = [mods[n].register_forward_pre_hook(keep(n)) for n in quantizers]
    block(*args)
    for h in hooks:
        h.remove()
    runs = {}
    for n, (x, rg) in got.items():
        x = x.requires_grad_(rg)  # the detached view: the forward's strides (a broadcast stays one)
        m = mods[n]
        owner = mods[n.rsplit(".", 1)[0]] if isinstance(m, SharedRequant) else None
        runs[n] = (lambda m=m, x=x, o=owner: m(x, o.input_quant)) if owner is not None else (lambda m=m, x=x: m(x))
        runs[n + " floor"] = lambda x=x: x * 1.5
    t = interleaved_times(runs, reps, clock=time.process_time, warmup=True)
    med = {k: _median_ms(v) for k, v in t.items()}
    ctx = in_context_times(block, args, quantizers, reps)
    total, floor = sum(med[n] for n in got), sum(med[n + " floor"] for n in got)
    in_ctx = sum(ctx.values())
    lines = [f"Its {len(got)} quantizer calls per forward (observing), each alone on its tensor: {total:.1f} ms "
             "together "
             f"({total / float_fwd:.2f}x the float block's forward), their `x * c` floor {floor:.1f} ms "
             f"({floor / float_fwd:.2f}x); in context (hooks in the block's forward) {in_ctx:.1f} ms "
             f"({in_ctx / float_fwd:.2f}x); the largest:", "",
             "| quantizer | elements | alone (ms) | / its floor | in context (ms) |", "|---|---|---|---|---|"]
    for n in sorted(got, key=lambda n: -ctx.get(n, 0.0))[:top]:
        lines.append(f"| {n} | {got[n][0].numel()} | {med[n]:.2f} | {med[n] / med[n + ' floor']:.1f}x | "
                     f"{ctx.get(n, float('nan')):.2f} |")
    return lines + [""]


def in_context_times(block, args, names, reps) -> dict:
    """Median CPU ms of each named submodule's call within ``reps`` forwards of ``block`` (its
    forward pre / post hooks; the inputs cloned per forward as in ``block_section``)."""
    query, ref, value, shapes = args
    mods, times, start = dict(block.named_modules()), {n: [] for n in names}, {}

    def pre(name):
        def hook(module, a):
            start[name] = time.process_time()
        return hook

    def post(name):
        def hook(module, a, out):
            times[name].append((time.process_time() - start[name]) * 1e3)
        return hook
    hooks = [mods[n].register_forward_pre_hook(pre(n)) for n in names]
    hooks += [mods[n].register_forward_hook(post(n)) for n in names]
    for i in range(reps + 1):
        if i == 1:
            for v in times.values():
                v.clear()  # the first forward is a warm-up
        block(query.clone(memory_format=torch.preserve_format).requires_grad_(), ref, value.clone().requires_grad_(),
              shapes)
    for h in hooks:
        h.remove()
    return {n: _median_ms(v) for n, v in times.items() if v}


def npu_profile_line(sess, feed, top=4):
    """dal.npu's ``Session.profile``: the ops with the largest share of its time (summed per op type)."""
    rows = sess.profile(feed, repeat=3)
    by_op = {}
    for r in rows:
        op = r["op"] + (" (fused group)" if r["kind"] == "fused" else "")
        by_op[op] = by_op.get(op, 0.0) + r["share"]
    best = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return ("dal.npu's time by op (Session.profile, medians of 3 runs, share of the steps' sum): "
            + ", ".join(f"{op} {100 * v:.0f}%" for op, v in best) + ".")


def speed_section(fair, train, test, path, reps, model="grid"):
    """Train step float vs QAT INT8 (fresh prepare + calibrate of the fair model), interleaved; then
    the exported QAT INT8 file on dal.npu vs onnxruntime (optimizations on and off), one thread."""
    import onnxruntime as ort

    import dal.npu

    images, targets = next(batches(train, BATCH, 1, seed=5))
    qat, _ = quantized(fair, recipe_for("int8_balanced", model), train, test, 0)
    dal.set_quantizer_state(qat, "quantize")
    steps = {"float": _step_fn(copy.deepcopy(fair), images, targets), "QAT INT8": _step_fn(qat, images, targets)}
    cpu = interleaved_times(steps, reps, clock=time.process_time, warmup=True)
    wall = interleaved_times(steps, max(3, reps // 3))
    ratios = sorted(q / f for f, q in zip(cpu["float"], cpu["QAT INT8"]))
    r = _median_ms(cpu["QAT INT8"]) / _median_ms(cpu["float"])
    lines = [f"Train step (forward, cross-entropy, backward, Adam), batch {BATCH} scenes ({BATCH * CAMERAS} camera images "
             f"{IMAGE}x{IMAGE}, BEV {CELLS}x{CELLS}), {reps} interleaved rounds, medians:", "",
             "| step | CPU (ms) | wall (ms) |", "|---|---|---|"]
    for k in steps:
        lines.append(f"| {k} | {_median_ms(cpu[k]):.1f} | {_median_ms(wall[k]):.1f} |")
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    lines += ["", f"QAT INT8 / float on CPU time: {r:.2f}x (per-round ratio quartiles {q1:.2f}-{q3:.2f}x; "
              f"{'ok' if r <= 1.25 else 'MISSED'}, target <= 1.25x).", ""]
    if model == "deform":
        lines += block_section(fair, qat, images, max(reps, 3 * reps))
    x = test.images[:BATCH].numpy()
    sess = dal.npu.load(path, threads=1)
    name = sess.input_names[0]
    runs = {"dal.npu": lambda: sess.run({name: x})}
    for label, level in (("ORT", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
                         ("ORT no-opt", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
        so = ort.SessionOptions()
        so.graph_optimization_level, so.intra_op_num_threads, so.inter_op_num_threads = level, 1, 1
        s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        runs[label] = (lambda s=s: s.run(None, {s.get_inputs()[0].name: x}))
    inf = interleaved_times(runs, reps, clock=time.process_time, warmup=True)
    npu = _median_ms(inf["dal.npu"])
    lines += [f"Inference of the exported QAT INT8 file, batch {BATCH}, one thread each, CPU time, medians of {reps} "
              "interleaved rounds (onnxruntime runs the GridSample / ScatterElements between DequantizeLinear and "
              "QuantizeLinear in float):", "",
              "| engine | CPU (ms) | dal.npu / engine |", "|---|---|---|"]
    for k, v in inf.items():
        lines.append(f"| {k} | {_median_ms(v):.1f} | {npu / _median_ms(v):.2f}x |")
    lines += ["", npu_profile_line(sess, {name: x})]
    return lines


def speed_only(args) -> int:
    """``--speed-only``: float pre-training (``--float-steps``, 300 unless given), the QAT INT8
    model prepared + calibrated from it and exported, then :func:`speed_section`."""
    torch.set_num_threads(1)
    fs = 10 if args.quick else (args.float_steps if args.float_steps != 1200 else 300)
    t0 = time.time()
    train, test = bev_scenes("train", 128 if args.quick else 2000), bev_scenes("test", 32 if args.quick else 512)
    torch.manual_seed(0)
    fair = MODELS[args.model]()
    train_steps(fair, train, fs, lr=LR, batch_size=BATCH)
    qm, _ = quantized(fair, recipe_for("int8_balanced", args.model), train, test, 0)
    path = export(qm, test.images[:2], tempfile.mkdtemp(prefix="dal-bev-"), "QAT INT8")
    cmd = f"python bench/bev.py --model {args.model} --speed-only" + (" --write" if args.write else "")
    out = [f"Speed section by `{cmd}` (float model after {fs} steps, the QAT INT8 model its calibration, no QAT "
           f"steps); dal from {os.path.dirname(os.path.dirname(dal.__file__))}; CPU: {cpu_flags()}; torch threads: "
           f"{torch.get_num_threads()}; load average at start "
           f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}.", ""]
    out += speed_section(fair, train, test, path, 3 if args.quick else args.reps, args.model)
    out += ["", f"Load average at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}; the speed run took "
            f"{time.time() - t0:.0f} s wall."]
    text = "\n".join(out)
    print(text)
    if args.write:
        name = "bev.md" if args.model == "grid" else f"bev_{args.model}.md"
        with open(os.path.join(ROOT, "bench", "results", name)) as f:
            old = f.read()
        keep = old.split("\nTrain step (")[0].split("\nSpeed section by `")[0].rstrip("\n")
        at = old.find("\nNotes (added by hand")  # the full run's hand-written notes stay
        write_result(name, keep + "\n\n" + text + "\n" + (old[at:] if at >= 0 else ""))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small budgets (smoke run)")
    ap.add_argument("--write", action="store_true", help="write bench/results/bev.md (bev_splat.md)")
    ap.add_argument("--model", choices=sorted(MODELS), default="grid", help="image-to-BEV: grid_sample, splat (scatter-add) or deform (grid_sample + MSDA)")
    ap.add_argument("--float-steps", type=int, default=1200, help="F (module doc)")
    ap.add_argument("--qat-steps", type=int, default=300, help="Q (module doc)")
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds of the speed section")
    ap.add_argument("--speed-only", action="store_true",
                    help="the speed section alone: F float steps (default 300 here), no accuracy rows; with --write "
                         "it replaces the speed part of the results file and keeps its tables")
    args = ap.parse_args(argv)
    if args.speed_only:
        return speed_only(args)
    torch.set_num_threads(1)
    n_train, n_test = (128, 32) if args.quick else (2000, 512)
    fs, qs = (10, 5) if args.quick else (args.float_steps, args.qat_steps)
    t0 = time.time()
    train, test = bev_scenes("train", n_train), bev_scenes("test", n_test)
    workdir = tempfile.mkdtemp(prefix="dal-bev-")
    head = [f"CPU: {cpu_flags()}; torch threads: {torch.get_num_threads()}; load average at start "
            f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}.", "",
            f"Data: examples/bev, {n_train} train / {n_test} test scenes (MNIST train / test digits), {CAMERAS} cameras "
            f"{IMAGE}x{IMAGE}, BEV grid {CELLS}x{CELLS} cells of 1 m; model {DESCRIBE[args.model]}; Adam, batch {BATCH}, hardware a2000. "
            "Occupancy mIoU: mean over {free, occupied} of the IoU over all test cells; digit-class accuracy: share "
            "of occupied cells whose argmax is their digit. NPU = dal.npu running the exported QDQ file, the same "
            "argmax and metric code for both columns. train CPU includes the shared float pre-training.", ""]
    rows, fair, (_, path) = accuracy_rows(train, test, fs, qs, workdir, args.model)
    out = head + table(rows) + [""] + [f"- {c}" for c in checks(rows)] + [""]
    out += speed_section(fair, train, test, path, 3 if args.quick else args.reps, args.model)
    out += ["", f"Load average at the end {' '.join(f'{v:.2f}' for v in os.getloadavg())}; the whole run took "
            f"{time.time() - t0:.0f} s wall."]
    text = "\n".join(out)
    print(text)
    if args.write:
        name = "bev.md" if args.model == "grid" else f"bev_{args.model}.md"
        write_result(name, f"# Multi-camera BEV on MNIST ground planes (`bench/bev.py --model {args.model}`)\n\n"
                     + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
