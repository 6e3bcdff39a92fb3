"""Benchmark: the deployed tiny Llama's decode and prefill speed (issue 43, Performance).

The model is bench/llm_common.py's tiny Llama (4 layers, width 256; its cached pre-trained weights
when present, else random weights from its config: the speed does not depend on the weights),
prepared with ``w4a8_int8_llm`` for the a2000 plus an INT8 per-tensor KV-cache rule (INT8: onnxruntime cannot take float8
inputs from Python), calibrated on held-out text, and written by ``dal.export_decoder`` as a
prefill graph (P = 128) and a decode graph (cache L = 256). All engines run on one thread, in one
interleaved run (each repetition runs every engine once, in turn):

- decode: one token at position P with a cache of P written entries;
  dal.npu (``dal.npu.load(path, threads=1)``) vs onnxruntime (1 intra-op thread, sequential,
  default graph optimizations but one: at its default level it refuses these files, see
  :data:`ORT_OFF`) on the same decode file, fed the same codes;
  the integer model (``dal.convert`` of the decode step, torch; eager, and captured whole by
  ``IntegerModel.compile_blocks("")``) vs the float model's eager decode
  (the same pre-trained weights, unprepared: transformers' LlamaForCausalLM, one token with its
  DynamicCache of P entries, cropped back to P after each step, as generate does one step);
- prefill: the same pairs on the P = 128 prompt (the float model's forward with ``use_cache``).

Ratios are speeds (tokens per second): peer's time / engine's time, wall and CPU time
(``time.process_time``, which a loaded machine distorts least on one thread). Targets (not
asserted): dal.npu / onnxruntime >= 1.0x, integer / float >= 0.5x. When dal.npu misses its
target, the table of where its time goes per op type (Session.profile) follows. Writes
bench/results/llm_npu.md.

    .venv/bin/python bench/llm_npu.py [--reps 15] [--layers 4] [--example-inputs]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one thread for every engine: dal.npu's float MatMuls run numpy float64 on OpenBLAS, whose own pool
# (2 threads here) ignores dal.npu's threads=1; set before numpy is imported
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cpu import cpu_flags  # noqa: E402
from results_file import write_result  # noqa: E402

RECIPE, HARDWARE = "w4a8_int8_llm", "a2000"
PROMPT, CACHE = 128, 256
#: the recipe has no KV-cache rule; export_decoder needs one: INT8 codes, one scale per tensor
#: onnxruntime 1.32 refuses these files at its default level (ORT_ENABLE_ALL) and at ORT_ENABLE_EXTENDED:
#: QDQPropagationTransformer and QDQS8ToU8Transformer together write a QuantizeLinear
#: (``.../Unsqueeze_1_output_0_q``, after the GQA Unsqueeze of the int8 cache codes) whose
#: output_dtype INT8 does not match its uint8 zero point (TypeInferenceError at session creation);
#: with either one of them off it loads. Both variants run, everything else at the default level;
#: the faster one is the peer (the stricter comparison for dal.npu).
ORT_OFF = ("QDQS8ToU8Transformer", "QDQPropagationTransformer")
KV_RULE = {"type": "kv_cache", "input": {"format": "int8", "granularity": "per_tensor", "symmetric": True}}


#: what the profile shows, in words (true of the graphs as dal.export_decoder writes them at this commit;
#: the figures are in the rows above it)
NOTES = """
## What the profile shows (export/SPEC.md §5a as dal.npu runs these graphs)

- Linears: the MLP's `up_proj` of every layer (its output goes straight to its quantizer) is
  §5a's blocked integer group ("fused" steps: dal/npu/blocked_groups.py); `q/k/v_proj` (read by
  Reshape), `gate_proj` (the FP16 SiLU island) and `o_proj` / `down_proj` (the float residual Add)
  are §5a's blocked linears with a float output ("blocked_float" steps): the same exact per-block
  arithmetic on the int8 x int4 codes, the float32 `v` handed to the float readers. Both are one
  C++ call (dal/npu/blocked_kernel.py, csrc/blocked_gemm.cpp: exact int32 sums per block of 32 by
  vpdpbusd, the float64 combine in ascending block order, the up_proj readers' requantizer), the
  numpy float64 matmul of the codes with the pre-scaled weight their fallback and oracle. Only
  `lm_head` (int8 per-channel weights in this recipe, a graph output) is a float island: its
  weight's DequantizeLinear runs once at load (constant_steps.py), its float64 copy is made once
  (const_matmul.py), one float64 numpy matmul per run.
- decode (one token): ~150 steps instead of ~460, each bit-identical to the nodes it replaces
  (`dal.npu.load(..., fuse_chains=False)` runs them one by one): the float nodes between the
  quantizers (the FP16 islands' Casts, RMSNorm, SiLU, softmax, rotary, head split) run as 32
  "chain" steps (dal/npu/fused_chains.py); the KV cache's grouped-head expansion requantized for
  the attention products and its `present_*` outputs are 256-entry code tables on the cache's
  codes, and the cache append is a Concat of codes (dal/npu/code_moves.py, "codes" steps); the
  SiLU island after its Cast to float16 is a 65,536-entry table (dal/npu/half_tables.py). What is
  left: the chains, the linears (int8 weights: a quarter of the float32 blocks' bytes), the
  attention MatMuls and ~45 small QuantizeLinear steps.
- prefill (128 tokens): the float chains (softmax ~0.5 ms per layer: numpy's float32 exp and its
  max over 128-element rows; RMSNorm ~0.25 ms each) and the linears (~4.3 ms for 28 calls: the
  exact block sums and the float64 combine, 6 vector operations per 16 columns, row and block
  against 8 vpdpbusd) lead, then the attention products (float64 matmuls of dequantized codes).
- OpenBLAS: numpy's float64 matmul runs on OpenBLAS, whose own thread pool ignores dal.npu's
  ``threads=1``; the bench pins it (OPENBLAS_NUM_THREADS=1). A user of dal.npu.load(threads=1) on a
  busy machine without the pin meets a slower, more variable figure. torch's own intra-op pool (the
  chains' float16 Casts and softmax row maximum) is held at the session's ``threads`` during a run
  (dal/npu/torch_threads.py; unpinned it made a loaded machine's prefill 4-7x slower).
- QuantizeLinear (C++, codes packed to bytes in registers) and the scalar DequantizeLinear / moves
  tables (a C++ 256-entry lookup from 4096 codes on, dal/npu/byte_tables.py) are ~1.2 ms of prefill.
- onnxruntime 1.32 refuses these files at its default level (see ORT_OFF in the bench): a graph
  optimizer bug, not a dal export error (the files load at ORT_ENABLE_BASIC and pass
  onnx.checker full_check); the bench's peer is onnxruntime with one of the two interacting
  optimizers off, the faster of the two.
"""


def float_model(layers: int | None = None):
    """(float LlamaForCausalLM in eval mode, where its weights came from). ``layers`` given: a
    random model of llm_common's config with that many layers (no cache lookup)."""
    import llm_common

    if layers is not None:
        import transformers as T

        cfg = dict(llm_common.CONFIG, num_hidden_layers=layers)
        torch.manual_seed(0)
        return T.LlamaForCausalLM(T.LlamaConfig(**cfg)).eval(), f"random weights, {layers} layer(s)"
    path = llm_common._cache_path()
    if os.path.exists(path):
        model, info = llm_common.pretrained(verbose=False)
        return model.eval(), f"pre-trained, cached ({info['path']})"
    return llm_common.build(0).eval(), "random weights (no cached pre-trained model; speed does not depend on them)"


def prepared(model, prompt_len: int, calib: list, example_inputs: bool = False):
    """A copy of ``model`` prepared with :data:`RECIPE` plus :data:`KV_RULE`, calibrated on ``calib`` ([1, P] id tensors), eval mode.
    ``example_inputs``: prepared with ``example_inputs=(calib[0],)``, so that prepare finds the decoder layer's
    functional calls (its residual adds) by call site and quantizes them."""
    import copy

    import dal

    rec = dal.load_recipe(RECIPE).with_rules_prepended([KV_RULE])
    p = dal.prepare_qat(copy.deepcopy(model), recipe=rec, hardware=HARDWARE,
                        example_inputs=(calib[0],) if example_inputs else None)
    dal.calibrate(p, calib)
    return p.eval()


class Engines:
    """The six callables of one run, on the files of ``dal.export_decoder(q, ...)`` and their inputs.

    ``fp``: the float model; ``q``: its prepared, calibrated copy; P = ``prompt_len``, L = ``cache_len``."""

    def __init__(self, fp, q, directory: str, prompt_len: int = PROMPT, cache_len: int = CACHE):
        import onnxruntime as ort
        from transformers import DynamicCache

        import dal
        import dal.npu
        from dal.convert import convert
        from dal.export.decoder import causal_mask
        from dal.export.decoder_module import CodesStep, DecoderStep

        P, L = prompt_len, cache_len
        self.pre_path, self.dec_path = dal.export_decoder(q, os.path.join(directory, "llm"), prompt_len=P,
                                                          cache_len=L)
        self.int_pre = convert(CodesStep(DecoderStep(q, L, False)))
        self.int_dec = convert(CodesStep(DecoderStep(q, L, True)))
        # the same integer models with the whole net captured (IntegerModel.compile_blocks("")) after a forward
        self.cap_pre = convert(CodesStep(DecoderStep(q, L, False)))
        self.cap_dec = convert(CodesStep(DecoderStep(q, L, True)))
        self.npu_pre, self.npu_dec = dal.npu.load(self.pre_path, threads=1), dal.npu.load(self.dec_path, threads=1)
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.ort = {(phase, off): ort.InferenceSession(path, so, providers=["CPUExecutionProvider"],
                                                       disabled_optimizers=[off])
                    for phase, path in (("prefill", self.pre_path), ("decode", self.dec_path)) for off in ORT_OFF}
        self.ort_pre, self.ort_dec = self.ort["prefill", ORT_OFF[0]], self.ort["decode", ORT_OFF[0]]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, fp.config.vocab_size, (1, P), generator=g)
        pre_in = (ids, torch.arange(P)[None], causal_mask(torch.ones(1, P, dtype=torch.bool), P, False))
        with torch.no_grad():
            pre_out = self.int_pre(*pre_in)
        caches = []  # the host's cache after the prefill: its P entries in slots 0..P-1
        for t in pre_out[1:]:
            c = torch.zeros(*t.shape[:2], L, t.shape[3], dtype=t.dtype)
            c[:, :, :P] = t
            caches.append(c)
        tok = int(pre_out[0][0, -1].argmax())
        dec_in = (torch.tensor([[tok]]), torch.tensor([[P]]),
                  causal_mask(torch.arange(L)[None] < P, 1, True), *caches)
        self.pre_in, self.dec_in = pre_in, dec_in
        with torch.no_grad():
            for m, x in ((self.cap_pre, pre_in), (self.cap_dec, dec_in)):
                m(*x)
                m.compile_blocks("")
            #: whether the captured models give the eager integer models' outputs, bit for bit
            self.captured_same = all(torch.equal(a, b) for m, c, x in ((self.int_pre, self.cap_pre, pre_in),
                                                                     (self.int_dec, self.cap_dec, dec_in))
                                     for a, b in zip(m(*x), c(*x)))
        names = lambda s: [i.name for i in s.get_inputs()]
        self.pre_np = dict(zip(names(self.ort_pre), [t.numpy() for t in pre_in]))
        self.dec_np = dict(zip(names(self.ort_dec), [t.numpy() for t in dec_in]))
        self.fp, self.ids, self.tok, self.P = fp, ids, torch.tensor([[tok]]), P
        with torch.no_grad():
            self.kv = fp(ids, use_cache=True, past_key_values=DynamicCache(config=fp.config)).past_key_values

    def float_decode(self):
        """One eager decode step of the float model on its P-entry cache, the cache cropped back after."""
        with torch.no_grad():
            out = self.fp(self.tok, past_key_values=self.kv, use_cache=True,
                          position_ids=torch.tensor([[self.P]]))
        self.kv.crop(-1)  # back to the P prompt entries (transformers 5: crop(-n) drops n)
        return out.logits

    def float_prefill(self):
        with torch.no_grad():
            return self.fp(self.ids, use_cache=True).logits

    @staticmethod
    def stepped(model, inputs):
        """``model(*inputs)`` without autograd: one step of an integer model."""
        with torch.no_grad():
            return model(*inputs)

    def runs(self) -> dict:
        """name -> callable, in the order each repetition runs them (``ort <phase> -<optimizer>``:
        onnxruntime with that one optimizer off, :data:`ORT_OFF`)."""
        ort = lambda phase, off, feed: (lambda: self.ort[phase, off].run(None, feed))
        return {"npu decode": lambda: self.npu_dec.run(self.dec_np),
                **{f"ort decode -{off}": ort("decode", off, self.dec_np) for off in ORT_OFF},
                "int decode": lambda: self.stepped(self.int_dec, self.dec_in),
                "cap decode": lambda: self.stepped(self.cap_dec, self.dec_in), "float decode": self.float_decode,
                "npu prefill": lambda: self.npu_pre.run(self.pre_np),
                **{f"ort prefill -{off}": ort("prefill", off, self.pre_np) for off in ORT_OFF},
                "int prefill": lambda: self.stepped(self.int_pre, self.pre_in),
                "cap prefill": lambda: self.stepped(self.cap_pre, self.pre_in), "float prefill": self.float_prefill}


def timed(runs: dict, reps: int) -> tuple[dict, dict]:
    """(median wall ms, median CPU ms) of each callable over ``reps`` interleaved repetitions, one
    untimed warm-up run each first."""
    for f in runs.values():
        f()
    wall, cpu = defaultdict(list), defaultdict(list)
    for _ in range(reps):
        for k, f in runs.items():
            t, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append((time.perf_counter() - t) * 1e3)
            cpu[k].append((time.process_time() - c) * 1e3)
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()})


def by_op(rows: list[dict]) -> list[tuple[str, int, float, float]]:
    """(op type, steps, ms, share) of ``Session.profile``'s ``rows``, summed per op type, slowest first."""
    acc = defaultdict(lambda: [0, 0.0])
    for r in rows:
        acc[r["op"]][0] += 1
        acc[r["op"]][1] += r["ms"]
    total = sum(v[1] for v in acc.values()) or 1.0
    return sorted(((k, n, ms, ms / total) for k, (n, ms) in acc.items()), key=lambda r: -r[2])


def constant_dequantizers(path: str) -> set:
    """Names of the DequantizeLinear nodes of the ONNX file ``path`` whose every input is an initializer."""
    import onnx

    g = onnx.load(path).graph
    init = {i.name for i in g.initializer}
    return {n.name for n in g.node if n.op_type == "DequantizeLinear" and all(i in init for i in n.input if i)}


def profile_lines(say, e: "Engines", ratios: dict) -> None:
    """For each phase where dal.npu misses 1.0x: where its time goes (Session.profile), per op type, by step
    kind, the share of constant-weight DequantizeLinear steps, and its slowest steps."""
    for phase, sess, feed in (("decode", e.npu_dec, e.dec_np), ("prefill", e.npu_pre, e.pre_np)):
        if ratios[f"npu {phase}"] >= 1.0:
            continue
        say()
        say(f"dal.npu {phase} misses 1.0x: where its time goes (Session.profile, medians of 5 runs, "
            "summed per op type)")
        say()
        say("| op | steps | ms | share |")
        say("|---|---|---|---|")
        rows = sess.profile(feed, repeat=5)
        for op, n, ms, share in by_op(rows)[:10]:
            say(f"| {op} | {n} | {ms:.3f} | {share:.0%} |")
        say()
        kinds = defaultdict(int)
        for r in rows:
            kinds[r["kind"]] += 1
        const = constant_dequantizers(e.dec_path if phase == "decode" else e.pre_path)
        wdq = sum(r["ms"] for r in rows if r["node"] in const)
        total = sum(r["ms"] for r in rows) or 1.0
        alone = []
        for _ in range(5):
            c = time.process_time()
            sess.run(feed)
            alone.append((time.process_time() - c) * 1e3)
        say(f"dal.npu {phase} run back to back (not interleaved), median of 5: {statistics.median(alone):.3f} CPU ms; "
            f"sum of its profiled steps: {sum(r['ms'] for r in rows):.3f} ms (the rest: per-run and per-step "
            "overhead outside the steps, or caches the interleaved peers evicted)")
        say()
        say(f"steps by kind: {dict(kinds)} (\"chain\" = connected float nodes run as one step, "
            f"dal/npu/fused_chains.py; \"codes\" = code tables: SiLU * up products, the KV cache's "
            f"requantized moves and append, dal/npu/fused_codes.py, code_moves.py; "
            f"\"fused\" = an integer group: here the blocked up_proj linears; "
            f"\"blocked_float\" = a blocked linear with a float output, export/SPEC.md §5a: q/k/v, gate, o, down; "
            f"lm_head a float-island MatMul on its weight dequantized at load); DequantizeLinear nodes of constant "
            f"weights: {len(const)} in the file, {sum(r['node'] in const for r in rows)} still run per step "
            f"(dal.npu computes constant steps once at load: dal/npu/constant_steps.py), {wdq:.3f} ms = "
            f"{wdq / total:.0%} of the profiled {total:.3f} ms")
        say()
        say("its slowest steps: " + "; ".join(f"{r['node']} ({r['op']}, {r['kind']}) {r['ms']:.3f} ms "
                                              f"{r['share']:.0%}" for r in rows[:6]))


def main(reps: int = 15, layers: int | None = None, write: bool = True, example_inputs: bool = False) -> str:
    torch.set_num_threads(1)
    fp, source = float_model(layers)
    import llm_common

    held = llm_common.data()[1]
    calib = [held[i * PROMPT: (i + 1) * PROMPT][None] for i in range(4)]
    q = prepared(fp, PROMPT, calib, example_inputs)
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory() as d:
        e = Engines(fp, q, d)
        load = os.getloadavg()[0]
        wall, cpu = timed(e.runs(), reps)
        load = max(load, os.getloadavg()[0])
        say("# Tiny Llama decode / prefill speed, one thread (bench/llm_npu.py)")
        say()
        say(f"command: `.venv/bin/python bench/llm_npu.py --reps {reps}" + (f" --layers {layers}" if layers else "")
            + (" --example-inputs`" if example_inputs else "`"))
        say(f"CPU: {cpu_flags()}")
        say(f"load average (1 min, highest of before / after): {load:.1f} on {os.cpu_count()} CPUs "
            "(a shared machine: wall times swing; CPU time distorts least)")
        say(f"model: llm_common tiny Llama ({source}), recipe {RECIPE} + {KV_RULE}, hardware {HARDWARE}; prefill P = {PROMPT}, "
            f"decode graph cache L = {CACHE}, decode at position {PROMPT} with {PROMPT} cached entries")
        import onnxruntime
        say(f"torch {torch.__version__}, threads 1; onnxruntime {onnxruntime.__version__}, ORT_ENABLE_ALL less one "
            "optimizer (below), 1 intra-op thread, sequential; dal.npu threads=1")
        say(f"{reps} interleaved repetitions, medians; ratio = speed (tokens/s) of the engine / its peer's = "
            "peer ms / engine ms")
        say()
        say("| phase | engine | ms | CPU ms | peer | peer ms | peer CPU ms | ratio wall (target) | ratio CPU time "
            "| engine tok/s |")
        say("|---|---|---|---|---|---|---|---|---|---|")
        ratios, peer_note = {}, {}
        for phase, toks in (("decode", 1), ("prefill", PROMPT)):
            for a, b, target in (("npu", "ort", 1.0), ("int", "float", 0.5), ("cap", "float", 0.5)):
                ka, kb = f"{a} {phase}", f"{b} {phase}"
                if b == "ort":  # the faster of the two loadable onnxruntime variants
                    kb = min((f"ort {phase} -{off}" for off in ORT_OFF), key=lambda k: wall[k])
                    peer_note[phase] = kb
                rw, rc = wall[kb] / wall[ka], cpu[kb] / cpu[ka]
                ratios[ka] = rw
                name = {"npu": "dal.npu", "ort": "onnxruntime", "int": "integer model (dal.convert), eager",
                        "cap": "integer model, captured (`compile_blocks(\"\")`)", "float": "float eager (transformers)"}
                say(f"| {phase} | {name[a]} | {wall[ka]:.2f} | {cpu[ka]:.2f} | {name[b]} | {wall[kb]:.2f} | {cpu[kb]:.2f} "
                    f"| {rw:.2f}x (>= {target}x) | {rc:.2f}x | {toks * 1e3 / wall[ka]:.0f} |")
        say()
        say("onnxruntime at its default level refuses these files (TypeInferenceError, see ORT_OFF in the "
            "bench); the peer is the faster of it with one optimizer off: " +
            "; ".join(f"{ph}: " + ", ".join(f"-{off} {wall[f'ort {ph} -{off}']:.2f} ms" for off in ORT_OFF) +
                      f" (peer: {peer_note[ph].split(' -')[1]} off)" for ph in ("decode", "prefill")))
        say()
        from dal.kernels import blocked_sums
        say("the captured integer models' outputs (logits, KV codes) equal the eager ones bit for bit: "
            f"{e.captured_same}; the blocked linears' kernel on AVX-512 VNNI (dal.kernels.blocked_sums.vnni()): "
            f"{blocked_sums.vnni()}")
        profile_lines(say, e, ratios)
    text = "\n".join(lines) + "\n" + NOTES
    if write:
        path = os.path.join(HERE, "results", "llm_npu.md")
        old = open(path).read() if os.path.exists(path) else ""
        write_result("llm_npu.md", merged(old, text))
    return text


#: the results file's generated part lies between these lines; everything outside them (dated
#: sections written by hand, bench/llm_int_profile.py's section) is kept on every run
BEGIN = "<!-- bench/llm_npu.py writes from here to its end marker on every run; the rest of the file is kept -->"
END = "<!-- end of bench/llm_npu.py's part -->"


def merged(old: str, generated: str) -> str:
    """The results file with ``generated`` between :data:`BEGIN` and :data:`END`, the rest of ``old``
    kept. ``old`` without the markers (written before them): its generated part is its start, up to
    the first ``## `` heading that is not this bench's own (NOTES'); from that heading on it is kept."""
    part = BEGIN + "\n" + generated.rstrip("\n") + "\n" + END + "\n"
    i, j = old.find(BEGIN), old.find(END)
    if i >= 0 and j > i:
        tail = old[j + len(END):].lstrip("\n")
        return old[:i] + part + ("\n" + tail if tail else "")
    own = {ln for ln in generated.splitlines() if ln.startswith("## ")}
    starts = [0] if old.startswith("## ") else []
    starts += [m + 1 for m in range(len(old)) if old.startswith("\n## ", m)]
    k = next((m for m in starts if old[m:].split("\n", 1)[0] not in own), -1)
    return part if k < 0 else part + "\n" + old[k:]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=None, help="random weights with this many layers (smoke runs)")
    ap.add_argument("--example-inputs", action="store_true",
                    help="prepare with example_inputs (residual adds quantized); prints, does not write the results file")
    a = ap.parse_args()
    main(a.reps, a.layers, write=not a.example_inputs, example_inputs=a.example_inputs)
