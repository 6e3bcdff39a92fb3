"""Low-bit accuracy on cluttered MNIST and MNIST: PTQ (min-max, the auto_quantize ladder,
AdaRound + bias correction, block-wise AdaRound) and QAT, against torch.ao's PTQ and QAT and
Brevitas's PTQ, measured in the same run.

Two models (``--model``), each its own section of the results file:

- ``mnist_cnn``: dal_examples.zoo.MnistCNN. Per-channel INT4 weights cost it well under a point, so there
  is nothing for AdaRound to win back.
- ``mobilenet_tiny``: dal_examples.zoo.MobileNetTiny(width 8), five depthwise-separable units, BN folded
  into the weights by prepare_qat, INT4 weights *per tensor* on every layer (the first conv and
  the classifier included, the YAML override of recipes/README.md): a folded depthwise layer's
  channels span very different ranges, so one min-max scale per tensor costs 10+ points; the
  per-channel rows are there too.

Every row of a section starts from the same float model (same training budget); the QAT rows
train ``--qat-steps`` more steps and are compared with the float model trained for the same extra
steps ("fair float"). PTQ rows are compared with the float model itself. Calibration: 256 images
of the valid split; the ladder's eval_fn uses 2000 other valid images; every accuracy in the
table is on the 10k test split.

    python bench/lowbit.py --model mobilenet_tiny   # rewrites that section of bench/results/lowbit.md
    python bench/lowbit.py                          # mnist_cnn (the default)
    python bench/lowbit.py --quick                  # smoke run (numbers not meaningful)
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
import time

import torch
from torch import nn

import dal
from dal.ptq import quantize_ptq
from dal_examples.training import accuracy
from dal_examples.zoo import MnistCNN, MobileNetTiny
from cpu import cpu_flags  # bench/cpu.py
from lowbit_peers import ao_fake, ao_ptq_int8, brevitas_ptq

W4A8_ALL_INT4 = {"name": "w4a8_all_int4", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
    {"type": ["add", "pool", "activation"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}
W4A8_PER_TENSOR = copy.deepcopy(W4A8_ALL_INT4)
W4A8_PER_TENSOR["name"] = "w4a8_per_tensor_all_int4"
W4A8_PER_TENSOR["rules"][0]["weight"]["granularity"] = "per_tensor"
W4A8_PER_TENSOR_LSQ = copy.deepcopy(W4A8_PER_TENSOR)
W4A8_PER_TENSOR_LSQ["name"] = "w4a8_per_tensor_all_int4_lsq"
for _spec in (W4A8_PER_TENSOR_LSQ["rules"][0]["weight"], W4A8_PER_TENSOR_LSQ["rules"][0]["input"]):
    _spec["learnable"] = True

AIMET_NOTE = ("peer not run: aimet-torch 2.42 has only a py310-none-any wheel (pip takes it on 3.11) that needs "
              "~35 more packages (bokeh, cvxpy, holoviews, panel, pandas, tensorboard, ...); not installed")
MODELS = {"mnist_cnn": lambda: MnistCNN(), "mobilenet_tiny": lambda: MobileNetTiny(8)}


def data(name: str, quick: bool):
    from dal_examples.datasets import load_cluttered_mnist, load_mnist
    from dal_examples.datasets.cluttered import MEAN, STD

    if name == "cluttered MNIST":
        split = {s: load_cluttered_mnist(s) for s in ("train", "valid", "test")}
        norm = lambda x: (x - MEAN) / STD  # noqa: E731
    else:
        split = load_mnist()
        norm = lambda x: (x - 0.1307) / 0.3081  # noqa: E731
    n_train = 3000 if quick else 20000
    xtr, ytr = split["train"][0][:n_train], split["train"][1][:n_train]
    xva, yva = split["valid"]
    xte, yte = split["test"]
    if quick:
        xte, yte = xte[:1000], yte[:1000]
    g = torch.Generator().manual_seed(0)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(norm(xtr), ytr), batch_size=64,
                                        shuffle=True, generator=g)
    calib = [(norm(xva[i:i + 32]), yva[i:i + 32]) for i in range(0, 256, 32)]
    val = [(norm(xva[i:i + 500]), yva[i:i + 500]) for i in range(2000, 4000, 500)]
    test = [(norm(xte[i:i + 1000]), yte[i:i + 1000]) for i in range(0, len(yte), 1000)]
    return train, calib, val, test


def train_float(train, epochs: int, model_name: str = "mnist_cnn"):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=epochs * len(train))
    for _ in range(epochs):
        model.train()
        for x, y in train:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
    return model.eval()


def extra_steps(model, train, steps: int, lr: float, params=None):
    """``steps`` more SGD steps (cosine-decayed lr): the same for QAT rows and the fair float row."""
    opt = torch.optim.SGD(params if params is not None else model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    done = 0
    while done < steps:
        for x, y in train:
            if done >= steps:
                break
            model.train()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
            done += 1
    return model.eval()


def dal_qat(fm, recipe, train, calib, steps, lr):
    q = dal.prepare_qat(copy.deepcopy(fm), recipe=recipe, hardware="a2000", example_inputs=(calib[0][0],))
    dal.calibrate(q, calib, progress=False, method="mse")
    return extra_steps(q, train, steps, lr)


def timed(fn):
    t = time.time()
    out = fn()
    return out, time.time() - t


def brevitas_rows(fm, calib, test, add, f_acc, per_channel: bool) -> None:
    """Brevitas W4A8 PTQ rows (all layers INT4; lowbit_peers.brevitas_ptq), or one row saying why not."""
    tag = "per channel" if per_channel else "per tensor"
    for gptq, label in ((False, "min-max + bias correction"), (True, "GPTQ + bias correction")):
        try:
            m, s = timed(lambda: brevitas_ptq(fm, calib, gptq, per_channel))
        except ImportError as e:
            add("brevitas", f"W4A8 PTQ ({tag}, all INT4)", None, f_acc, 0.0,
                f"peer not run: {e} (pip install --no-deps brevitas dependencies==2.0.1 unfoldNd)")
            return
        add("brevitas", f"W4A8 PTQ {label} ({tag}, all INT4)", accuracy(m, test), f_acc, s)
    add("brevitas", f"W4A8 PTQ learned round ({tag})", None, f_acc, 0.0,
        "peer not run: brevitas_examples' learned round needs accelerate (not installed)")
    add("aimet-torch", "W4A8 PTQ AdaRound", None, f_acc, 0.0, AIMET_NOTE)


def w4_ptq_rows(name, fm, calib, test, add, f_acc, ada, tag, rec) -> dict:
    """dal W4A8 PTQ rows for ``rec``: min-max, AdaRound (layer / block) + bias correction."""
    res = {}
    for key, label, steps, extra in (
            ("mm", "min-max", (), {}),
            ("ada", "AdaRound + bias correction", ("adaround", "bias_correction"), {}),
            ("block", "block-wise AdaRound (BRECQ) + bias correction", ("adaround", "bias_correction"),
             {"block": "block"}),
            ("eq", "equalize + AdaRound + bias correction", ("equalize", "adaround", "bias_correction"), {})):
        m, s = timed(lambda: quantize_ptq(fm, rec, calib, hardware="a2000", steps=steps, method="minmax",
                                          adaround_args={**ada, **extra}))
        res[key] = accuracy(m, test)
        add("dal", f"W4A8 PTQ {label} ({tag})", res[key], f_acc, s)
    return res


def int8_ptq_rows(fm, calib, val, test, add, f_acc, ada) -> float:
    """INT8 PTQ: dal min-max, dal's ladder (auto_quantize), torch.ao's int8 model; returns the ladder's accuracy."""
    m, s = timed(lambda: quantize_ptq(fm, "int8_balanced", calib, hardware="a2000", method="minmax"))
    add("dal", "INT8 PTQ min-max", accuracy(m, test), f_acc, s)
    res, s = timed(lambda: dal.auto_quantize(fm, calib, lambda mod: accuracy(mod, val), max_drop=0.5,
                                             hardware="a2000", recipe="int8_balanced", progress=False,
                                             adaround_args=ada))
    ladder = accuracy(res.model, test)
    add("dal", "INT8 PTQ ladder (auto_quantize, max_drop 0.5 on valid)", ladder, f_acc, s,
        f"settled on: {res.chosen} ({res.status})")
    m, s = timed(lambda: ao_ptq_int8(fm, calib))
    add("torch.ao", "INT8 PTQ (eager, qnnpack int8 model)", accuracy(m, test), f_acc, s)
    return ladder


def run_mobilenet(name: str, args, rows: list, checks: list) -> None:
    """The mobilenet_tiny section (module docstring)."""
    train, calib, val, test = data(name, args.quick)
    t0 = time.time()
    fm = train_float(train, 1 if args.quick else args.epochs, "mobilenet_tiny")
    f_acc = accuracy(fm, test)
    steps, lr = (20 if args.quick else args.qat_steps), 0.01
    fair = accuracy(extra_steps(copy.deepcopy(fm), train, steps, lr), test)
    add = lambda tool, label, acc, base, sec, note="": rows.append(  # noqa: E731
        (name, tool, label, acc, None if acc is None else acc - base, sec, note))
    add("-", "float", f_acc, f_acc, time.time() - t0)
    add("-", f"float + {steps} steps (fair baseline for QAT)", fair, fair, 0.0)
    ada = {"iters": 100 if args.quick else 500}
    ladder = int8_ptq_rows(fm, calib, val, test, add, f_acc, ada)
    pt = w4_ptq_rows(name, fm, calib, test, add, f_acc, ada, "per tensor, all INT4", W4A8_PER_TENSOR)
    m, s = timed(lambda: ao_fake(fm, calib, 4, per_channel=False))
    add("torch.ao", "W4A8 PTQ min-max (eager fake quant, per tensor, all INT4)", accuracy(m, test), f_acc, s)
    brevitas_rows(fm, calib, test, add, f_acc, per_channel=False)
    w4_ptq_rows(name, fm, calib, test, add, f_acc, ada, "per channel, all INT4", W4A8_ALL_INT4)
    qat = {}
    for label, rec in (("W4A8 QAT (per tensor, all INT4)", W4A8_PER_TENSOR),
                       ("W4A8 QAT LSQ (per tensor, all INT4, learnable: true)", W4A8_PER_TENSOR_LSQ),
                       ("INT8 QAT", "int8_balanced")):
        m, s = timed(lambda: dal_qat(fm, rec, train, calib, steps, lr))
        qat[label] = accuracy(m, test)
        add("dal", label, qat[label], fair, s)
    for bits, label in ((4, "W4A8 QAT (eager, per tensor, all INT4)"), (8, "INT8 QAT (eager)")):
        m, s = timed(lambda: ao_fake(fm, calib, bits, per_channel=bits == 8,
                                     train=lambda n: extra_steps(n, train, steps, lr)))
        add("torch.ao", label, accuracy(m, test), fair, s)
    best_qat = max(v for k, v in qat.items() if k.startswith("W4A8"))
    best_ada = max(pt["ada"], pt["block"])
    checks += [
        (name, "W4A8 QAT (per tensor, all INT4; best of plain / LSQ) within 1.5 points of the fair float",
         fair - best_qat <= 1.5, f"{best_qat:.2f} vs {fair:.2f}"),
        (name, "W4A8 PTQ AdaRound + BC (per tensor, all INT4; best of layer / block) within 3 points of float",
         f_acc - best_ada <= 3, f"{best_ada:.2f} vs {f_acc:.2f} (layer {pt['ada']:.2f}, block {pt['block']:.2f})"),
        (name, "... and >= 5 points better than min-max W4A8 PTQ (per tensor, all INT4)", best_ada - pt["mm"] >= 5,
         f"{best_ada:.2f} vs {pt['mm']:.2f}"),
        (name, "INT8 PTQ with the ladder within 0.5 points of float", f_acc - ladder <= 0.5,
         f"{ladder:.2f} vs {f_acc:.2f}"),
    ]
    print(f"[{name}] done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def run(name: str, args, rows: list, checks: list) -> None:
    train, calib, val, test = data(name, args.quick)
    t0 = time.time()
    fm = train_float(train, 1 if args.quick else args.epochs)
    f_acc = accuracy(fm, test)
    steps, lr = (20 if args.quick else args.qat_steps), 0.01
    fair = accuracy(extra_steps(copy.deepcopy(fm), train, steps, lr), test)
    add = lambda tool, label, acc, base, sec, note="": rows.append(  # noqa: E731
        (name, tool, label, acc, None if acc is None else acc - base, sec, note))
    add("-", "float", f_acc, f_acc, time.time() - t0)
    add("-", f"float + {steps} steps (fair baseline for QAT)", fair, fair, 0.0)

    ada = {"iters": 100 if args.quick else 500}
    ptq = lambda rec, steps=(), method="minmax": quantize_ptq(  # noqa: E731
        fm, rec, calib, hardware="a2000", steps=steps, method=method, adaround_args=ada)
    ladder = int8_ptq_rows(fm, calib, val, test, add, f_acc, ada)
    results = {}
    for tag, rec in (("all INT4", W4A8_ALL_INT4), ("first conv + last linear INT8", "w4a8_fp8_performance")):
        m, s = timed(lambda: ptq(rec))
        results[(tag, "mm")] = accuracy(m, test)
        add("dal", f"W4A8 PTQ min-max ({tag})", results[(tag, "mm")], f_acc, s)
        m, s = timed(lambda: ptq(rec, ("adaround", "bias_correction")))
        results[(tag, "ada")] = accuracy(m, test)
        add("dal", f"W4A8 PTQ AdaRound + bias correction ({tag})", results[(tag, "ada")], f_acc, s)
        m, s = timed(lambda: ptq(rec, ("equalize", "adaround", "bias_correction")))
        add("dal", f"W4A8 PTQ equalize + AdaRound + bias correction ({tag})", accuracy(m, test), f_acc, s)
    m, s = timed(lambda: ao_fake(fm, calib, 4))
    add("torch.ao", "W4A8 PTQ (eager fake quant, all INT4)", accuracy(m, test), f_acc, s)
    brevitas_rows(fm, calib, test, add, f_acc, per_channel=True)
    qat = {}
    for label, rec in (("W4A8 QAT (first conv + last linear INT8)", "w4a8_fp8_performance"),
                       ("W4A8 QAT (all INT4)", W4A8_ALL_INT4), ("W4A8 QAT LSQ (w4a8_lsq)", "w4a8_lsq"),
                       ("INT8 QAT", "int8_balanced")):
        m, s = timed(lambda: dal_qat(fm, rec, train, calib, steps, lr))
        qat[label] = accuracy(m, test)
        add("dal", label, qat[label], fair, s)
    m, s = timed(lambda: ao_fake(fm, calib, 4, train=lambda n: extra_steps(n, train, steps, lr)))
    add("torch.ao", "W4A8 QAT (eager, all INT4)", accuracy(m, test), fair, s)
    m, s = timed(lambda: ao_fake(fm, calib, 8, train=lambda n: extra_steps(n, train, steps, lr)))
    add("torch.ao", "INT8 QAT (eager)", accuracy(m, test), fair, s)
    best_w4_qat = max(qat[k] for k in qat if k.startswith("W4A8"))
    tag = "all INT4"
    checks += [
        (name, "W4A8 QAT within 1.5 points of the fair float", fair - best_w4_qat <= 1.5,
         f"{best_w4_qat:.2f} vs {fair:.2f}"),
        (name, f"W4A8 PTQ AdaRound + BC ({tag}) within 3 points of float", f_acc - results[(tag, "ada")] <= 3,
         f"{results[(tag, 'ada')]:.2f} vs {f_acc:.2f}"),
        (name, f"... and >= 5 points better than min-max W4A8 PTQ ({tag})",
         results[(tag, "ada")] - results[(tag, "mm")] >= 5, f"{results[(tag, 'ada')]:.2f} vs {results[(tag, 'mm')]:.2f}"),
        (name, "INT8 PTQ with the ladder within 0.5 points of float", f_acc - ladder <= 0.5,
         f"{ladder:.2f} vs {f_acc:.2f}"),
    ]
    print(f"[{name}] done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


def write_section(path: str, model: str, text: str) -> None:
    """Replace (or append) the ``model`` section of the results file, keeping the other's."""
    start, end = f"<!-- section {model} -->", f"<!-- /section {model} -->"
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = "# bench/lowbit.py\n\n" + (__doc__ or "").split("\n\n")[0] + "\n"
    block = f"{start}\n{text}{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=tuple(MODELS), default="mnist_cnn")
    ap.add_argument("--quick", action="store_true", help="small budgets (smoke run, numbers not meaningful)")
    ap.add_argument("--epochs", type=int, default=3, help="float training epochs over 20k images")
    ap.add_argument("--qat-steps", type=int, default=400, help="extra steps of the QAT rows and the fair float")
    ap.add_argument("--write", metavar="PATH", default=None, help="results file (default bench/results/lowbit.md)")
    ap.add_argument("--data", choices=("cluttered MNIST", "MNIST"), action="append",
                    help="only this data set (repeatable; default both)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    title = "dal_examples.zoo.MobileNetTiny(8)" if args.model == "mobilenet_tiny" else "dal_examples.zoo.MnistCNN"
    header = [f"## {args.model} ({title})",
              "", f"CPU: {cpu_flags()}; torch {torch.__version__}, 1 thread", ""]
    rows: list = []
    checks: list = []
    for name in args.data or ("cluttered MNIST", "MNIST"):
        (run_mobilenet if args.model == "mobilenet_tiny" else run)(name, args, rows, checks)
    lines = header + ["| data | tool | row | test accuracy | vs its baseline | time s | note |",
                      "|---|---|---|---|---|---|---|"]
    for d, tool, label, acc, delta, sec, note in rows:
        a = f"{acc:.2f}%" if acc is not None else "-"
        dl = f"{delta:+.2f}" if delta is not None else "-"
        lines.append(f"| {d} | {tool} | {label} | {a} | {dl} | {sec:.1f} | {note} |")
    lines += ["", "| data | claim | met | figures |", "|---|---|---|---|"]
    lines += [f"| {d} | {c} | {'yes' if ok else 'NO'} | {fig} |" for d, c, ok, fig in checks]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick or args.write:
        write_section(args.write or "bench/results/lowbit.md", args.model, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
