"""Low-bit accuracy on cluttered MNIST and MNIST: PTQ (min-max, the auto_quantize ladder,
AdaRound + bias correction) and QAT, against torch.ao's PTQ and QAT, measured in the same run.

Every row starts from the same float model (dal.zoo.MnistCNN, the same training budget); the QAT
rows train ``--qat-steps`` more steps and are compared with the float model trained for the
same extra steps ("fair float"). PTQ rows are compared with the float model itself. Calibration:
256 images of the valid split; the ladder's eval_fn uses 2000 other valid images; every
accuracy in the table is on the 10k test split.

    python bench/lowbit.py                 # writes bench/results/lowbit.md
    python bench/lowbit.py --quick         # smoke run (numbers not meaningful)
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from torch import nn

import dal
from dal.ptq import quantize_ptq
from dal.training import accuracy, train_epoch
from dal.zoo import MnistCNN
from cpu import cpu_flags  # bench/cpu.py

W4A8_ALL_INT4 = {"name": "w4a8_all_int4", "rules": [
    {"type": ["conv", "linear"],
     "weight": {"format": "int4", "granularity": "per_channel", "symmetric": True, "observer": "minmax"},
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
    {"type": ["add", "pool", "activation"],
     "input": {"format": "int8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}


def data(name: str, quick: bool):
    from dal.datasets import load_cluttered_mnist, load_mnist
    from dal.datasets.cluttered import MEAN, STD

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


def train_float(train, epochs: int):
    torch.manual_seed(0)
    model = MnistCNN()
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


class AoNet(nn.Module):
    """MnistCNN with the stubs torch.ao's eager mode needs (same layers, same weights)."""

    def __init__(self, m: MnistCNN):
        super().__init__()
        from torch.ao.nn.quantized import FloatFunctional
        from torch.ao.quantization import DeQuantStub, QuantStub

        self.quant, self.dequant, self.skip = QuantStub(), DeQuantStub(), FloatFunctional()
        self.stem, self.down, self.conv, self.bn, self.relu = m.stem, m.down, m.conv, m.bn, m.relu
        self.down2, self.pool, self.head = m.down2, m.pool, m.head

    def forward(self, x):
        x = self.down(self.stem(self.quant(x)))
        x = self.relu(self.skip.add(x, self.bn(self.conv(x))))
        return self.dequant(self.head(self.pool(self.down2(x)).flatten(1)))


FUSE = [["stem.0", "stem.1", "stem.2"], ["down.0", "down.1", "down.2"], ["conv", "bn"], ["down2.0", "down2.1", "down2.2"]]


def ao_qconfig(bits: int):
    """torch.ao fake-quant qconfig: per-channel symmetric ``bits``-bit weights, 8-bit affine activations."""
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, QConfig
    from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver as PerChannel

    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = FakeQuantize.with_args(observer=PerChannel, quant_min=lo, quant_max=hi, dtype=torch.qint8,
                               qscheme=torch.per_channel_symmetric, ch_axis=0)
    a = FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
                               qscheme=torch.per_tensor_affine, reduce_range=False)
    return QConfig(activation=a, weight=w)


def ao_ptq_int8(fm, calib):
    """torch.ao eager PTQ: fuse, observe, convert to the real int8 model (qnnpack engine)."""
    torch.backends.quantized.engine = "qnnpack"
    net = AoNet(copy.deepcopy(fm)).eval()
    torch.ao.quantization.fuse_modules(net, FUSE, inplace=True)
    net.qconfig = torch.ao.quantization.get_default_qconfig("qnnpack")
    torch.ao.quantization.prepare(net, inplace=True)
    with torch.no_grad():
        for x, _ in calib:
            net(x)
    return torch.ao.quantization.convert(net)


def ao_fake(fm, calib, train, bits: int, steps: int, lr: float):
    """torch.ao eager fake-quant model (PTQ when ``steps`` is 0: observers see calib, then frozen)."""
    net = AoNet(copy.deepcopy(fm)).train()
    torch.ao.quantization.fuse_modules_qat(net, FUSE, inplace=True)
    net.qconfig = ao_qconfig(bits)
    torch.ao.quantization.prepare_qat(net, inplace=True)
    net.apply(torch.ao.quantization.disable_fake_quant)
    net.eval()
    with torch.no_grad():
        for x, _ in calib:
            net(x)
    net.apply(torch.ao.quantization.enable_fake_quant)
    if steps:
        extra_steps(net, train, steps, lr)
    net.apply(torch.ao.quantization.disable_observer)
    return net.eval()


def brevitas_row(fm, calib, test):
    """Brevitas peer: not wired up yet. brevitas 0.13.4 installs here with ``--no-deps`` (plus
    ``dependencies==2.0.1 unfoldNd``) without touching torch; aimet-torch 2.42 ships only a
    py310 wheel with heavy dependencies (bokeh, cvxpy, holoviews, ...) and was not installed."""
    try:
        import brevitas  # noqa: F401
    except ImportError:
        return None, "peer not run: brevitas not installed (it installs with --no-deps; not wired up yet)"
    return None, "peer not run: brevitas installed, its learned-round PTQ not wired up yet"


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

    def timed(fn):
        t = time.time()
        out = fn()
        return out, time.time() - t

    ada = {"iters": 100 if args.quick else 500}
    ptq = lambda rec, steps=(), method="minmax": quantize_ptq(  # noqa: E731
        fm, rec, calib, hardware="a2000", steps=steps, method=method, adaround_args=ada)
    m, s = timed(lambda: ptq("int8_balanced"))
    int8_mm = accuracy(m, test)
    add("dal", "INT8 PTQ min-max", int8_mm, f_acc, s)
    res, s = timed(lambda: dal.auto_quantize(fm, calib, lambda mod: accuracy(mod, val), max_drop=0.5,
                                             hardware="a2000", recipe="int8_balanced", progress=False,
                                             adaround_args=ada))
    ladder = accuracy(res.model, test)
    add("dal", "INT8 PTQ ladder (auto_quantize, max_drop 0.5 on valid)", ladder, f_acc, s,
        f"settled on: {res.chosen} ({res.status})")
    m, s = timed(lambda: ao_ptq_int8(fm, calib))
    add("torch.ao", "INT8 PTQ (eager, qnnpack int8 model)", accuracy(m, test), f_acc, s)
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
    m, s = timed(lambda: ao_fake(fm, calib, train, 4, 0, lr))
    add("torch.ao", "W4A8 PTQ (eager fake quant, all INT4)", accuracy(m, test), f_acc, s)
    acc, note = brevitas_row(fm, calib, test)
    add("brevitas", "W4A8 PTQ learned round", acc, f_acc, 0.0, note)
    qat = {}
    for label, rec in (("W4A8 QAT (first conv + last linear INT8)", "w4a8_fp8_performance"),
                       ("W4A8 QAT (all INT4)", W4A8_ALL_INT4), ("W4A8 QAT LSQ (w4a8_lsq)", "w4a8_lsq"),
                       ("INT8 QAT", "int8_balanced")):
        m, s = timed(lambda: dal_qat(fm, rec, train, calib, steps, lr))
        qat[label] = accuracy(m, test)
        add("dal", label, qat[label], fair, s)
    m, s = timed(lambda: ao_fake(fm, calib, train, 4, steps, lr))
    add("torch.ao", "W4A8 QAT (eager, all INT4)", accuracy(m, test), fair, s)
    m, s = timed(lambda: ao_fake(fm, calib, train, 8, steps, lr))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small budgets (smoke run, numbers not meaningful)")
    ap.add_argument("--epochs", type=int, default=3, help="float training epochs over 20k images")
    ap.add_argument("--qat-steps", type=int, default=400, help="extra steps of the QAT rows and the fair float")
    ap.add_argument("--write", metavar="PATH", default=None, help="results file (default bench/results/lowbit.md)")
    ap.add_argument("--data", choices=("cluttered MNIST", "MNIST"), action="append",
                    help="only this data set (repeatable; default both)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    header = [f"CPU: {cpu_flags()}; torch {torch.__version__}, 1 thread", ""]
    rows: list = []
    checks: list = []
    for name in args.data or ("cluttered MNIST", "MNIST"):
        run(name, args, rows, checks)
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
        with open(args.write or "bench/results/lowbit.md", "w") as f:
            f.write("# bench/lowbit.py\n\n" + (__doc__ or "").split("\n\n")[0] + "\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
