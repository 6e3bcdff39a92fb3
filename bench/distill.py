"""Knowledge distillation for QAT on MNIST: the same QAT student trained with and without its float teacher.

For each recipe: a float MnistCNN is trained (the teacher), ``prepare_qat`` copies it, calibrates
on 16 batches, then QAT fine-tunes for ``--steps`` steps (of the data the teacher was trained on) twice from the same calibrated state:
plain cross-entropy, and ``dal.distill.KDLoss(teacher, T=4, alpha=0.5)``. Both runs see the
same batches in the same order. Prints a table of test accuracies (full 10k test set) and the
difference, per recipe and seed; medians last. Peer: the same student without KD, in the same run.

    python bench/distill.py [--steps 150] [--seeds 0 1 2] [--recipes int8_balanced w4a8_fp8_performance]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--teacher-epochs", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--recipes", nargs="+", default=["int8_balanced", "w4a8_fp8_performance"])
    ap.add_argument("--train-limit", type=int, default=5000)
    ap.add_argument("--width", type=int, default=8, help="MnistCNN width (small: quantization hurts more)")
    args = ap.parse_args()

    import dal
    from dal_examples.datasets import mnist_loaders
    from dal.distill import KDLoss
    from dal_examples.training import accuracy, train_epoch
    from dal_examples.zoo import MnistCNN

    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    rows = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        train, test = mnist_loaders(batch_size=64, train_limit=args.train_limit, seed=seed)
        teacher = MnistCNN(width=args.width)
        opt = torch.optim.SGD(teacher.parameters(), lr=0.05, momentum=0.9)
        for _ in range(args.teacher_epochs):
            train_epoch(teacher, train, opt)
        float_acc = accuracy(teacher, test)
        batches = []
        for x, y in train:  # one fixed sequence of batches for both students
            batches.append((x, y))
            if len(batches) >= args.steps:
                break
        for recipe in args.recipes:
            base = dal.prepare_qat(copy.deepcopy(teacher), recipe, "a2000", example_inputs=(batches[0][0][:1],))
            dal.calibrate(base, batches[:16], progress=False)
            ptq = accuracy(base, test)
            accs = {}
            for mode in ("plain", "kd"):
                student = copy.deepcopy(base)
                loss_fn = KDLoss(teacher, T=4.0, alpha=0.5) if mode == "kd" else None
                opt = torch.optim.SGD(student.parameters(), lr=0.01, momentum=0.9)
                student.train()
                for x, y in batches:
                    opt.zero_grad(set_to_none=True)
                    out = student(x)
                    loss = loss_fn(out, y, x) if loss_fn else F.cross_entropy(out, y)
                    loss.backward()
                    opt.step()
                accs[mode] = accuracy(student, test)
            rows.append((recipe, seed, float_acc, ptq, accs["plain"], accs["kd"]))
            print(f"[{time.time() - t0:6.1f}s] {recipe} seed {seed}: float {float_acc:.2f} ptq {ptq:.2f} "
                  f"qat {accs['plain']:.2f} qat+kd {accs['kd']:.2f}", flush=True)

    print()
    print(f"MNIST test accuracy (%), MnistCNN(width={args.width}), teacher: {args.teacher_epochs} float epochs on "
          f"{args.train_limit} images; QAT: {args.steps} steps, SGD lr 0.01; KD: T=4, alpha=0.5")
    print("| recipe | seed | float teacher | PTQ | QAT | QAT + KD | KD - QAT |")
    print("|---|---|---|---|---|---|---|")
    for recipe, seed, f, p, q, k in rows:
        print(f"| {recipe} | {seed} | {f:.2f} | {p:.2f} | {q:.2f} | {k:.2f} | {k - q:+.2f} |")
    for recipe in args.recipes:
        mine = [r for r in rows if r[0] == recipe]
        q = statistics.median(r[4] for r in mine)
        k = statistics.median(r[5] for r in mine)
        print(f"| {recipe} | median | {statistics.median(r[2] for r in mine):.2f} | "
              f"{statistics.median(r[3] for r in mine):.2f} | {q:.2f} | {k:.2f} | {k - q:+.2f} |")


if __name__ == "__main__":
    main()
