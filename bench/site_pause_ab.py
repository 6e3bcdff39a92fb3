"""A/B of dal/prepare/site_pause.py in one process: a call-site owner's forward with its callees run
off the mode's stack (as prepare_qat installs it) against the same model with the pause disabled
(``call_sites.pause_callees`` a no-op for every forward of that copy, from prepare on), interleaved,
CPU time, one thread; outputs compared bit for bit.

- ``--model bev``: examples/bev's deformable block (``DeformBEV.attn``, MSDeformAttn), QAT forward with
  its quantizers observing (train mode, autograd on), against the float block;
- ``--model llama``: bench/llm_npu.py's tiny Llama prepared with example_inputs (its decoder layers are
  call-site owners), ``dal.convert`` of its decode step (bench/llm_npu.py's Engines inputs).

    .venv/bin/python bench/site_pause_ab.py --model bev [--reps 40]
    .venv/bin/python bench/site_pause_ab.py --model llama [--reps 80]

Prints only (the numbers go to bench/results/bev_deform.md's dated sections by hand).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "bev"))

from cpu import cpu_flags  # noqa: E402
from dal.prepare import call_sites  # noqa: E402


@contextlib.contextmanager
def no_pause(on: bool = True):
    """``call_sites.pause_callees`` a no-op inside (when ``on``): the owners' callees keep the mode."""
    real = call_sites.pause_callees
    if on:
        call_sites.pause_callees = lambda *args: None
    try:
        yield
    finally:
        call_sites.pause_callees = real


def bev_arms():
    """{arm: run() -> output} for the float block and the QAT block without / with the pause."""
    import dal
    from bev import _block_inputs, quantized
    from bev_deform import DeformBEV
    from bev_scenes import bev_scenes
    from train_bev import batches, train_steps

    torch.manual_seed(0)
    train, test = bev_scenes("train", 256), bev_scenes("test", 32)
    fair = DeformBEV()
    train_steps(fair, train, 5, batch_size=16)
    images, _ = next(batches(train, 16, 1, seed=5))
    query, ref, value, shapes = _block_inputs(copy.deepcopy(fair), images)
    arms = {"float": (copy.deepcopy(fair.attn).train(), False)}
    for label, off in (("QAT observing, no pause", True), ("QAT observing, pause", False)):
        with no_pause(off):
            qat, _ = quantized(fair, "int8_balanced", train, test, 0)
            arms[label] = (dal.set_quantizer_state(qat.attn, "quantize").train(), off)

    def run(block, off):
        def go():
            q = query.clone(memory_format=torch.preserve_format).requires_grad_()
            with no_pause(off):
                return block(q, ref, value.clone().requires_grad_(), shapes)
        return go
    return {k: run(*v) for k, v in arms.items()}


def llama_arms():
    """{arm: run() -> outputs} for the integer model's decode step without / with the pause."""
    import llm_common
    import llm_npu
    from dal.convert import convert
    from dal.export.decoder import causal_mask
    from dal.export.decoder_module import CodesStep, DecoderStep

    fp, _ = llm_npu.float_model(None)
    held = llm_common.data()[1]
    P, L = llm_npu.PROMPT, llm_npu.CACHE
    calib = [held[i * P: (i + 1) * P][None] for i in range(4)]
    steps = {}
    for label, off in (("integer decode, no pause", True), ("integer decode, pause", False)):
        with no_pause(off):
            q = llm_npu.prepared(fp, P, calib, example_inputs=True)
            steps[label] = (convert(CodesStep(DecoderStep(q, L, False))), convert(CodesStep(DecoderStep(q, L, True))), off)
    pre, _, off = steps["integer decode, no pause"]
    ids = torch.randint(0, fp.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), no_pause(off):
        out = pre(ids, torch.arange(P)[None], causal_mask(torch.ones(1, P, dtype=torch.bool), P, False))
    caches = []
    for t in out[1:]:
        c = torch.zeros(*t.shape[:2], L, t.shape[3], dtype=t.dtype)
        c[:, :, :P] = t
        caches.append(c)
    dec_in = (out[0][:, -1:].argmax(-1), torch.tensor([[P]]), causal_mask(torch.arange(L)[None] < P, 1, True), *caches)

    def run(dec, off):
        def go():
            with torch.no_grad(), no_pause(off):
                return dec(*dec_in)
        return go
    return {k: run(dec, off) for k, (_, dec, off) in steps.items()}


def _flat(x):
    return [x] if torch.is_tensor(x) else [t for v in x for t in _flat(v)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("bev", "llama"), default="bev")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    arms = bev_arms() if args.model == "bev" else llama_arms()
    a, b = list(arms)[-2:]
    same = all(torch.equal(x, y) for x, y in zip(_flat(arms[a]()), _flat(arms[b]())))
    for f in arms.values():  # warm-up
        f()
    times = {k: [] for k in arms}
    for _ in range(args.reps):
        for k, f in arms.items():
            c = time.process_time()
            f()
            times[k].append((time.process_time() - c) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = sorted(y / x for x, y in zip(times[a], times[b]))
    q = [ratios[int(p * (len(ratios) - 1))] for p in (0.25, 0.5, 0.75)]
    print(f"CPU: {cpu_flags()}; torch threads 1; {args.reps} interleaved rounds, CPU time medians; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    base = med.get("float")
    for k, v in med.items():
        print(f"  {k}: {v:.2f} ms" + (f" ({v / base:.3f}x float)" if base else ""))
    print(f"  pause / no pause per round: quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}; first outputs "
          f"bit-identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
