"""Where a dal QAT step's quantizer time goes: per quantizer kind, the calls that decline the C++
kernel, and the tensors two quantizers both read (the profile behind bench/results/qat_step.md,
"MobileNetV3-Large at 224").

    python bench/qat_step_profile.py [--case mnv3l-224] [--batch 8] [--steps 3]

The model and step are bench/qat_step.py's (its ``dal_model``, SGD lr 1e-3, one torch thread).
After two warm-up steps, each FakeQuantizer call of the timed steps is measured with
``time.thread_time_ns`` around its forward (the class's forward is wrapped in this process; module
hooks would turn the fused FP16 islands off), so these are forward times only; the fused Hardswish
/ Hardsigmoid islands and QConvBn2d's folded weights do not call their quantizers' forward and are
not in the table. Printed: per (format, granularity, state) the calls, values and milliseconds per
step; the calls where the kernel declined (``_kernel_forward`` gave None: the torch path ran); the
tensors read by more than one quantizer in one forward (same storage, same version).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from qat_step import CASES, dal_model, step_fn  # bench/qat_step.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=list(CASES), default="mnv3l-224")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after two warm-up steps)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from dal.quantizer import FakeQuantizer

    arch, size = CASES[args.case]
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, size, size)
    y = torch.randint(0, 1000, (args.batch,))
    model = dal_model(arch, x)
    step = step_fn(model, x, y)

    for _ in range(2):
        step()
    forward, kernel_forward = FakeQuantizer.forward, FakeQuantizer._kernel_forward
    time_ns, values, calls = collections.Counter(), collections.Counter(), collections.Counter()
    declined, readers = collections.Counter(), collections.defaultdict(list)

    def timed(q, t):
        kind = (q.fmt.name, "per tensor" if q.granularity.axis is None else "per channel", q.state.value)
        readers[(t.data_ptr(), t._version, tuple(t.shape))].append(q.name)
        start = time.thread_time_ns()
        out = forward(q, t)
        time_ns[kind] += time.thread_time_ns() - start
        values[kind] += t.numel()
        calls[kind] += 1
        return out

    def watched(q, t):
        out = kernel_forward(q, t)
        if out is None:
            declined[q.name] += 1
        return out

    FakeQuantizer.forward, FakeQuantizer._kernel_forward = timed, watched
    try:
        losses = []
        for _ in range(args.steps):
            readers.clear()
            losses.append(float(step()))
    finally:
        FakeQuantizer.forward, FakeQuantizer._kernel_forward = forward, kernel_forward
    n = args.steps
    print(f"{arch} {size}, batch {args.batch}, {n} timed steps, losses {losses}")
    print("| format | granularity | state | calls / step | M values / step | forward ms / step | ns / value |")
    print("|---|---|---|---|---|---|---|")
    for kind in sorted(time_ns, key=lambda k: -time_ns[k]):
        print(f"| {' | '.join(kind)} | {calls[kind] / n:.0f} | {values[kind] / n / 1e6:.2f} | "
              f"{time_ns[kind] / n / 1e6:.1f} | {time_ns[kind] / values[kind]:.2f} |")
    print(f"kernel declined (torch path): {sum(declined.values())} calls"
          + (f", e.g. {list(declined)[:5]}" if declined else ""))
    shared = [(k[2], v) for k, v in readers.items() if len(v) > 1]
    total = sum(torch.Size(s).numel() * (len(v) - 1) for s, v in shared)
    print(f"tensors read by more than one quantizer in the last forward: {len(shared)}, "
          f"{total / 1e6:.2f} M values read again")
    for shape, names in shared:
        print(f"  {list(shape)}: {', '.join(names)}")


if __name__ == "__main__":
    main()
