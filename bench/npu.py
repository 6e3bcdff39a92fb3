"""Benchmark: dal.npu vs onnxruntime on ResNet-18 QDQ (quantize_static, random weights, per-channel
s8 weights, u8 or s8 activations), 224x224, batch 1 and 8, one and two threads, interleaved
repetitions, medians; the exact int8 GEMM alone against the peak of the instruction it runs,
measured by a register-only AMX tdpbusd / vpdpbusd / vpmaddwd loop (bench/npu_peak.cpp; on an
AMX CPU the AMX peak is the machine's int8 peak, and avx512_vnni is timed beside it); where dal.npu's time goes
(Session.profile).

onnxruntime: default (full) graph optimizations, i.e. its fused QLinearConv kernels, with
intra_op_num_threads = the thread count, sequential execution. It is the speed peer, not an
oracle (its kernels saturate in int16 on CPUs without VNNI). With more than one thread its
session config ``session.intra_op.allow_spinning`` is "0" by default here (``--ort-spinning 1``:
onnxruntime's own default): a threading setting, not a graph optimization -- its idle workers
otherwise spin after each of its runs and take the core dal.npu's second thread needs in the
interleaved rows (the bench prints which setting ran).

The peer-written rows (peer_file): the same network as a user's tool chain writes it, torchvision's
float export straight into quantize_static, without quant_pre_process (issue 39).

Targets (not asserted): one thread u8s8 <= 1.0x onnxruntime (both files), s8s8 <= 0.5x; two threads >= 1.7x
one thread; GEMM >= 80% of the int8 peak. Writes bench/results/npu.md.

    .venv/bin/python bench/npu.py [--reps 9] [--rounds 5] [--peer-only]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "npu"))


def _peak_module():
    """bench/npu_peak.cpp, built once; it includes dal.npu's AMX kernel and requantizer headers
    (amx_gemm_phases), listed as dependencies so that an edit of them rebuilds it."""
    from dal.npu.build import build_extension
    csrc = os.path.join(HERE, "..", "dal", "npu", "csrc")
    deps = [os.path.join(csrc, f) for f in ("qconv_amx.h", "qconv_requant.h", "isa.h")]
    return build_extension("dal_npu_peak", [os.path.join(HERE, "npu_peak.cpp")], ["-O2", "-ffp-contract=off"],
                           depends=deps, message="bench: compiling the peak loop into {dir}")


def peak_gops(kernel: str) -> tuple[float, str]:
    """One thread's int8 peak for the instruction family ``kernel`` uses: best of 40 short
    loops (~3 ms each: on a shared machine a short run is more likely to own its core)."""
    mod = _peak_module()
    fn, what, iters = {"amx_int8": (mod.amx_tdpbusd, "AMX tdpbusd, 2x2 tiles", 20_000),
                       "avx512_vnni": (mod.zmm_vnni, "vpdpbusd zmm", 1_000_000),
                       "avx_vnni": (mod.ymm_vnni, "vpdpbusd ymm", 1_000_000),
                       "avx2": (mod.ymm_madd, "vpmaddwd+vpaddd ymm", 1_000_000)}.get(kernel, (None, "none", 0))
    if fn is None:
        return float("nan"), what
    return max(fn(iters) for _ in range(40)), what


def amx_load_bound() -> dict:
    """GOP/s of npu_peak.cpp's 2 x 2 tdpbusd step with its 4 operand tiles loaded every step
    from random bytes cycled over 32 KiB (L1) / 512 KiB (L2), and ("split") with the A tiles from
    16 KiB (L1, as dal.npu's K blocks keep the rows) and the B tiles from 512 KiB: best of 40 each."""
    mod = _peak_module()
    out = {kib: max(mod.amx_tdpbusd_loads(20_000, kib) for _ in range(40)) for kib in (32, 512)}
    out["split"] = max(mod.amx_tdpbusd_loads(20_000, 512, 16) for _ in range(40))
    return out


def _isa(kernel):
    from dal.npu.build import kernels as lib
    from dal.npu.dispatch import NAMES
    return int(lib().best_isa()) if kernel is None else NAMES.index(kernel)


def _best_seconds(call, reps: int) -> float:
    """The fastest of ``reps`` timed calls of ``call``, after one untimed call (warm-up)."""
    call()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t)
    return min(ts)


def _torch_owned(a: np.ndarray):
    """``a`` copied into torch's own (64-byte aligned) memory, as every activation between two
    fused steps is (each kernel's output is a torch tensor); numpy's buffers start 16 bytes into
    a line, and AMX tile rows read in place must not straddle two lines (csrc/qconv_amx.h)."""
    import torch
    t = torch.empty(a.shape, dtype=torch.uint8)
    t.numpy()[...] = a
    return t


def amx_phases(m=784, k=2304, n=256, reps=41) -> tuple[float, float, float]:
    """Microseconds of dal.npu's AMX GEMM phases on ``m x k x n`` (npu_peak.cpp amx_gemm_phases,
    C++ timers, medians): the tiles alone, the requantizer alone, both as the fused call runs them."""
    return tuple(_peak_module().amx_gemm_phases(m, k, n, reps))


def gemm_gops(m=784, k=2304, n=256, reps=41, threads=1, kernel=None) -> float:
    """GOP/s of the fused exact int8 GEMM (u8 codes x s8 weights -> u8 codes, a layer3-sized
    conv as GEMM), with ``kernel`` (None: the one dal.npu picks); best of ``reps`` (shared machine)."""
    import torch
    from dal.npu import kernels
    from dal.npu.build import kernels as lib
    from dal.npu.dispatch import has_vnni
    rng = np.random.default_rng(0)
    x = _torch_owned(rng.integers(0, 256, (m, k)).astype(np.uint8))
    w = rng.integers(-127, 128, (n, k))
    mult = kernels.pad_channels(np.full(n, 1e-4), n, np.float64)
    e32, ef, e64 = (torch.empty(0, dtype=t) for t in (torch.int32, torch.float32, torch.int64))
    isa = _isa(kernel)
    bp, ws = kernels.pack_weights(w, has_vnni(isa))
    args = (x, 128, bp, ws, n, mult, e32, ef, e64, e64, 0, 0.05, 128, 0, 255, 1, e32, threads, isa)
    return 2 * m * k * n / _best_seconds(lambda: lib().qgemm(*args), reps) / 1e9


def conv_gops(cin, cout, hw, k=3, reps=41, threads=1, kernel=None) -> float:
    """GOP/s of one fused exact conv as the network runs it (pixel-major u8 codes in and out,
    stride 1, padding k // 2), with ``kernel`` (None: the default); best of ``reps``."""
    import torch
    from dal.npu import kernels
    from dal.npu.build import kernels as lib
    from dal.npu.dispatch import has_vnni
    rng = np.random.default_rng(1)
    x = _torch_owned(rng.integers(0, 256, (1, hw, hw, cin)).astype(np.uint8))
    w = rng.integers(-127, 128, (cout, cin, k, k))
    isa = _isa(kernel)
    vnni = has_vnni(isa)
    wm = kernels.conv_weight_matrix(w, True, 4 if vnni else 2)
    bp, ws = kernels.pack_weights(wm, vnni)
    mult = kernels.pad_channels(np.full(cout, 1e-4), cout, np.float64)
    e32, ef, e64 = (torch.empty(0, dtype=t) for t in (torch.int32, torch.float32, torch.int64))
    p = k // 2
    args = (x, 128, bp, ws, cout, k, k, 1, 1, 1, 1, p, p, hw, hw, True, mult, e32, ef, e64, e64, 0, 0.05, 128,
            0, 255, 1, e32, threads, isa, 3)
    return 2 * hw * hw * cout * cin * k * k / _best_seconds(lambda: lib().qconv(*args), reps) / 1e9


def batch_model(path: str) -> str:
    """The same file with a free batch dimension (input/output dim 0 named N, no value_info)."""
    import onnx
    out = path.replace(".onnx", ".batchN.onnx")
    if not os.path.exists(out):
        m = onnx.load(path)
        for vi in list(m.graph.input) + list(m.graph.output):
            vi.type.tensor_type.shape.dim[0].dim_param = "N"
        del m.graph.value_info[:]
        onnx.save(m, out)
    return out


ORT_SPINNING = "0"  # session.intra_op.allow_spinning of the peer with threads > 1 (--ort-spinning)


def compare(path, batch, threads, reps, x=None):
    """Interleaved medians of dal.npu and onnxruntime on ``path`` (a file, or the model's bytes)
    fed ``x`` (default: a random [batch, 3, 224, 224] image): (wall ms npu, wall ms ort, CPU ms
    npu, CPU ms ort, session). CPU time (process_time) is the figure a loaded machine distorts
    least at one thread: a preempted run's wall time grows, its CPU time does not."""
    import onnxruntime as ort
    import dal.npu as npu
    if x is None:
        x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads > 1:  # a threading setting (its idle workers do not spin), no graph change
        so.add_session_config_entry("session.intra_op.allow_spinning", ORT_SPINNING)
    o = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    s = npu.load(path, threads=threads)
    o.run(None, {"input": x})
    s.run({"input": x})
    wall, cpu = {"n": [], "o": []}, {"n": [], "o": []}
    # With more than one thread, the runtime that just ran leaves its idle workers spinning (libgomp
    # and onnxruntime's pool both spin before they sleep), and a sleeping worker is slow to wake:
    # timed right after the other runtime, dal.npu with 2 threads took ~29 ms for a run that takes
    # 4.5 ms back to back (measured, batch 1). So with threads > 1 each timed run follows one
    # untimed run of the same runtime: both are timed in their steady state, as a validation loop
    # runs them, and still interleaved, run pair by run pair.
    warm = threads > 1
    for _ in range(reps):
        for k, f in (("n", lambda: s.run({"input": x})), ("o", lambda: o.run(None, {"input": x}))):
            if warm:
                f()
            t, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    med = lambda v: statistics.median(v) * 1e3
    return med(wall["n"]), med(wall["o"]), med(cpu["n"]), med(cpu["o"]), s


def alone_scaling(path, batch, reps) -> float:
    """dal.npu's one-thread time over its two-thread time on ``path``, the two sessions
    interleaved run by run (each timed run after an untimed one of the same session), no other
    runtime in between: medians."""
    import dal.npu as npu
    x = {"input": np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)}
    sessions = {t: npu.load(path, threads=t) for t in (1, 2)}
    times = {1: [], 2: []}
    for _ in range(reps):
        for t, s in sessions.items():
            s.run(x)
            start = time.perf_counter()
            s.run(x)
            times[t].append(time.perf_counter() - start)
    return statistics.median(times[1]) / statistics.median(times[2])


def scaling_lines(say, path, rounds=5):
    """Which steps scale: Session.profile at one and two threads (u8s8, batch 1), the two
    sessions alternated ``rounds`` times (7 runs each), per-step medians over the rounds; by
    kind and the five steps that lose most against 1.85x."""
    import dal.npu as npu
    x = {"input": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    sessions = {t: npu.load(path, threads=t) for t in (1, 2)}
    ms = {1: {}, 2: {}}
    kinds = {}
    for _ in range(rounds):
        for t, s in sessions.items():
            for r in s.profile(x, repeat=7):
                ms[t].setdefault(r["node"], []).append(r["ms"])
                kinds[r["node"]] = r["kind"]
    med = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in ms.items()}
    say("Two threads against one, per step (u8s8, batch 1, Session.profile, one- and two-thread sessions alternated):")
    by = {}
    for k, kind in kinds.items():
        a = by.setdefault(kind, [0.0, 0.0])
        a[0] += med[1][k]
        a[1] += med[2][k]
    say("  by kind: " + ", ".join(f"{kind} {a:.2f} -> {b:.2f} ms ({a / b:.2f}x)" for kind, (a, b) in by.items()))
    loss = sorted(kinds, key=lambda k: -(med[2][k] - med[1][k] / 1.85))
    for k in loss[:5]:
        say(f"  {med[1][k]:6.3f} -> {med[2][k]:6.3f} ms ({med[1][k] / med[2][k]:.2f}x)  {kinds[k]:6s} {k}")


def detector_lines(say, reps, rounds):
    """The dense-prediction issue's detector: dal's DigitDetector export (bench/fan_out.py), the
    same interleaved medians as ResNet-18's rows, batch 1 and 32, one and two threads."""
    from fan_out import digit_detector  # bench/fan_out.py
    proto, images = digit_detector()
    data = proto.SerializeToString()
    say("DigitDetector (dal's own export, int8_balanced / a2000, 64x64 MNIST scenes; no target in the issue):")
    say()
    say("| batch | threads | dal.npu ms | onnxruntime ms | ratio wall | ratio CPU time |")
    say("|---|---|---|---|---|---|")
    for batch in (1, 32):
        for threads in (1, 2):
            runs = [compare(data, batch, threads, max(3, reps // (4 if batch > 1 else 1)), images[:batch])[:4]
                    for _ in range(rounds)]
            mn, mo, cn, co = (statistics.median(c) for c in zip(*runs))
            say(f"| {batch} | {threads} | {mn:.2f} | {mo:.2f} | {mn / mo:.2f}x | {cn / co:.2f}x |")


def peer_file(directory: str, per_channel: bool, hw: int = 224) -> str:
    """ResNet-18 as a user's own tool chain writes it (issue 39): torchvision's float export
    (zoo.export_torchvision, TorchScript, opset 17) straight into onnxruntime's quantize_static
    (QDQ, u8 activations, s8 weights), no quant_pre_process -- so the exporter's Identity nodes
    (one shared zero bias per group of Convs) stay in the file. Cached by name in ``directory``."""
    import zoo
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    out = os.path.join(directory, f"resnet18_{hw}_u8_{'pc' if per_channel else 'pt'}.peer.qdq.onnx")
    if not os.path.exists(out):
        fp = os.path.join(directory, f"resnet18_{hw}.float.onnx")
        if not os.path.exists(fp):
            zoo.export_torchvision("resnet18", fp, hw)
        quantize_static(fp, out, zoo._RandomReader("input", (1, 3, hw, hw)), quant_format=QuantFormat.QDQ,
                        per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return out


def peer_lines(say, directory, reps, rounds):
    """The peer-written files (peer_file, per-channel and per-tensor): how many Conv/Gemm run as
    fused integer groups, then dal.npu vs onnxruntime (default optimizations), batch 1, one
    thread, interleaved, the median over ``rounds`` of per-round medians."""
    import onnx
    say("ResNet-18 224 as quantize_static writes it from torchvision's float export (no quant_pre_process: "
        "the exporter's Identity nodes carry 16 of the 20 Conv biases), u8s8, batch 1, one thread:")
    say()
    say("| weights | fused groups / Conv+Gemm | dal.npu ms | onnxruntime ms | ratio wall (target <= 1.0x) | ratio CPU time | load |")
    say("|---|---|---|---|---|---|---|")
    for pc in (True, False):
        path = peer_file(directory, pc)
        convs = sum(n.op_type in ("Conv", "Gemm", "MatMul") for n in onnx.load(path).graph.node)
        runs = []
        for _ in range(rounds):
            la = os.getloadavg()[0]
            *t, s = compare(path, 1, 1, reps)
            runs.append(tuple(t) + (la,))
        fused = sum(st.kind == "fused" for st in s.steps)
        mn, mo, cn, co, la = (statistics.median(c) for c in zip(*runs))
        say(f"| {'per-channel' if pc else 'per-tensor'} | {fused} / {convs} | {mn:.1f} | {mo:.1f} | "
            f"{mn / mo:.2f}x | {cn / co:.2f}x | {la:.1f} |")


def kernel_lines(say, chosen):
    """The int8 peaks (register-only; AMX also with its operands loaded from L1 / L2), the exact
    fused GEMM and the ResNet-18 3x3 convs, one thread, for ``chosen`` (and avx512_vnni beside
    amx_int8), each against the peak of the instruction it runs."""
    kinds = [chosen] + (["avx512_vnni"] if chosen == "amx_int8" else [])
    peaks = {kd: peak_gops(kd) for kd in kinds}
    for kd in kinds:
        say(f"int8 peak, one thread ({peaks[kd][1]}, register-only loop): {peaks[kd][0]:.0f} GOP/s"
            + (" <- this machine's int8 peak" if kd == chosen else ""))
    if chosen == "amx_int8":  # what the 2 x 2 tile blocking reaches once its operands are loaded
        lb = amx_load_bound()
        say(f"AMX 2x2 tdpbusd step with its 4 operand tiles loaded every step (random bytes), one thread: "
            f"from L1 (32 KiB cycled) {lb[32]:.0f} GOP/s = {lb[32] / peaks[chosen][0]:.0%} of the peak, "
            f"from L2 (512 KiB) {lb[512]:.0f} GOP/s = {lb[512] / peaks[chosen][0]:.0%}, A from L1 (16 KiB) and B from "
            f"L2 (512 KiB) {lb['split']:.0f} GOP/s = {lb['split'] / peaks[chosen][0]:.0%}: the bounds of a GEMM on this blocking")
    for kd in kinds:
        peak, what = peaks[kd]
        g1 = gemm_gops(kernel=kd)
        say(f"exact fused int8 GEMM 784x2304x256, one thread, {kd}: {g1:.0f} GOP/s = {g1 / peak:.0%} of "
            f"the {what} peak (target >= 80%)")
        if kd == "amx_int8":  # where that call's time goes: the kernel's phases, C++ timers
            tt, tr, tb = amx_phases()
            ops = 2 * 784 * 2304 * 256 / 1e3
            say(f"  its phases (the same AMX kernel and requantizer called from C++, medians): tiles alone "
                f"{tt:.0f} us = {ops / tt:.0f} GOP/s = {ops / tt / peak:.0%} of the peak; requantizer alone {tr:.0f} us; "
                f"both, as the fused call interleaves them, {tb:.0f} us = {ops / tb / peak:.0%}; the fused call "
                f"{ops / g1:.0f} us (the rest: the Python call, output allocation, row pointers)")
    for cin, hw in ((64, 56), (128, 28), (256, 14), (512, 7)):
        part = []
        for kd in kinds:
            gc = conv_gops(cin, cin, hw, kernel=kd)
            part.append(f"{kd} {gc:.0f} GOP/s = {gc / peaks[kd][0]:.0%} of its peak")
        say(f"exact fused 3x3 conv {cin}->{cin} at {hw}x{hw} (ResNet-18 layer, pixel-major codes), one thread: "
            + "; ".join(part))


def peer_main(reps: int, rounds: int):
    """--peer-only: the CPU flags and the peer-written rows alone (printed, nothing written)."""
    import dal.npu as npu
    info = npu.info()
    print(f"CPU SIMD flags (/proc/cpuinfo): {' '.join(info['cpu_flags'])}")
    print(f"kernel chosen: {info['kernel']}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    d = os.path.join(tempfile.gettempdir(), "dal_bench_models")
    os.makedirs(d, exist_ok=True)
    peer_lines(lambda s="": print(s, flush=True), d, reps, rounds)


def main(reps: int = 9, rounds: int = 5, ort_spinning: str = "0"):
    global ORT_SPINNING
    ORT_SPINNING = ort_spinning
    import zoo
    import dal.npu as npu
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    info = npu.info()
    say("# dal.npu vs onnxruntime (bench/npu.py)")
    say()
    say(f"CPU SIMD flags (/proc/cpuinfo): {' '.join(info['cpu_flags'])}")
    say(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine: times swing)")
    say(f"kernel chosen: {info['why']}")
    say(f"onnxruntime: default graph optimizations (ORT_ENABLE_ALL); with 2 threads its session config "
        f"session.intra_op.allow_spinning = {ORT_SPINNING!r} ({'idle workers sleep' if ORT_SPINNING == '0' else 'its default: idle workers spin'}; "
        "a threading setting, not a graph optimization)")
    kernel_lines(say, info["kernel"])
    say()
    d = os.path.join(tempfile.gettempdir(), "dal_bench_models")
    os.makedirs(d, exist_ok=True)
    say(f"{rounds} rounds; each row: the median over rounds of interleaved medians ({reps} runs per "
        "round at batch 1, a quarter at batch 8); ratio = dal.npu / onnxruntime, wall time and CPU time")
    say()
    say("| model | batch | threads | dal.npu ms | onnxruntime ms | ratio wall (target) | ratio CPU time | load |")
    say("|---|---|---|---|---|---|---|---|")
    results, prof = {}, None
    models = {}
    for act in ("u8", "s8"):
        p1 = zoo.torchvision_qdq("resnet18", d, hw=224, activation=act, per_channel=True)
        models[act] = (p1, batch_model(p1))
    rows = {}
    for _ in range(rounds):
        for act in ("u8", "s8"):
            for batch in (1, 8):
                for threads in (1, 2):
                    r = max(3, reps // (4 if batch > 1 else 1))
                    la = os.getloadavg()[0]
                    *t, s = compare(models[act][0 if batch == 1 else 1], batch, threads, r)
                    rows.setdefault((act, batch, threads), []).append(tuple(t) + (la,))
                    if prof is None and act == "u8" and batch == 1 and threads == 1:
                        prof = s.profile({"input": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}, repeat=7)
    for (act, batch, threads), v in rows.items():
        mn, mo, cn, co, la = (statistics.median(c) for c in zip(*v))
        results[act, batch, threads] = mn
        target = ("<= 1.0x" if act == "u8" else "<= 0.5x") if threads == 1 else "-"
        say(f"| resnet18 224 {act}s8 per-channel | {batch} | {threads} | {mn:.1f} | {mo:.1f} | "
            f"{mn / mo:.2f}x ({target}) | {cn / co:.2f}x | {la:.1f} |")
    say()
    for act in ("u8", "s8"):
        for batch in (1, 8):
            alone = alone_scaling(models[act][0 if batch == 1 else 1], batch, max(10, reps * 4 // (4 if batch > 1 else 1)))
            say(f"two-thread scaling, {act}s8 batch {batch}: {results[act, batch, 1] / results[act, batch, 2]:.2f}x "
                f"from the rows above, {alone:.2f}x with dal.npu alone (target >= 1.7x)")
    say("(The rows above interleave dal.npu with onnxruntime" + (
        ", whose idle workers spin for a while after each of its runs and take a core from dal.npu's second "
        "thread" if ORT_SPINNING == "1" else " with its idle workers not spinning (allow_spinning 0)")
        + "; 'alone' interleaves dal.npu's one- and two-thread sessions only.)")
    say()
    peer_lines(say, d, reps, rounds)
    say()
    detector_lines(say, reps, rounds)
    say()
    say("Where the time goes (u8s8, batch 1, one thread, Session.profile, medians of 7):")
    by_kind = {}
    for r in prof:
        by_kind[r["kind"]] = by_kind.get(r["kind"], 0.0) + r["ms"]
    say("  by kind: " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    for r in prof[:8]:
        say(f"  {r['ms']:6.2f} ms {r['share']:5.1%}  {r['op']:16s} {r['kind']:6s} {r['node']}")
    scaling_lines(say, models["u8"][0])
    out = os.path.join(HERE, "results", "npu.md")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        cmd = " ".join([".venv/bin/python bench/npu.py"] + sys.argv[1:])
        f.write("\n".join(lines) + f"\n\nCommand: `{cmd}`\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ort-spinning", choices=("0", "1"), default="0",
                    help="onnxruntime's session.intra_op.allow_spinning with 2 threads (1: its default)")
    ap.add_argument("--peer-only", action="store_true",
                    help="only the peer-written ResNet-18 rows, printed (bench/results/npu.md untouched)")
    a = ap.parse_args()
    if a.peer_only:
        peer_main(a.reps, a.rounds)
    else:
        main(a.reps, a.rounds, a.ort_spinning)
