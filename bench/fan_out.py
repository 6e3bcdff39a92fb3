"""Fan-out and pass-through integer groups in dal.npu: before / after in one interleaved run.

"before" is the same file loaded with the previous matching (a group only when its chain has
exactly one reader, a QuantizeLinear; no MaxPool / Resize before it), obtained by switching
group_chain's fan-out and pass-through rules off for that one load; "after" is dal.npu as it
is; the peer is onnxruntime with its default optimizations on the same file. One thread each.

    python bench/fan_out.py            # writes bench/results/fan_out.md
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from cpu import cpu_flags  # bench/cpu.py  # noqa: E402
from results_file import write_result  # bench/results_file.py  # noqa: E402
from timing import interleaved_medians  # bench/timing.py  # noqa: E402


def _sessions(proto):
    import onnxruntime as ort

    import dal.npu
    from dal.npu import group_chain as gc
    now = dal.npu.load(proto, threads=1)
    keep = gc.fan_out_readers, gc.pass_through_ok
    gc.fan_out_readers, gc.pass_through_ok = (lambda g, n: []), (lambda g, n: False)
    try:
        old = dal.npu.load(proto, threads=1)
    finally:
        gc.fan_out_readers, gc.pass_through_ok = keep
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return now, old, ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def measure(label, proto, x, reps) -> list[str]:
    now, old, o = _sessions(proto)
    feed = {now.input_names[0]: x}
    a, b, c = now.run(feed), old.run(feed), o.run(None, feed)
    runs = {"dal.npu after": lambda: now.run(feed), "dal.npu before": lambda: old.run(feed),
            "onnxruntime": lambda: o.run(None, feed)}
    med = interleaved_medians(runs, reps)
    float_convs = lambda s: [st.node_name for st in s.steps if st.kind == "node" and st.node.op_type == "Conv"]
    post = lambda st: getattr(st, "post", None)
    groups = [f"{st.node_name} ({len(st.outputs)} reader(s){', ' + post(st).op_type + ' of the codes' if post(st) else ''})"
              for st in now.steps if st.kind == "fused" and (len(st.outputs) > 1 or post(st))]
    diff = [int((p != q).sum()) for p, q in zip(a, b)]
    return [f"## {label}", "", "| engine | ms / batch |", "|---|---|",
            *[f"| {k} | {v:.1f} |" for k, v in med.items()], "",
            f"- float Conv nodes before: {float_convs(old)}; after: {float_convs(now) or 'none'}",
            f"- new integer groups: {', '.join(groups)}",
            f"- output elements that changed (float islands -> exact integer groups): {diff} of "
            f"{[p.size for p in a]}; max |output - onnxruntime's| (dequantized values, onnxruntime's "
            f"own fused arithmetic, not a parity check): after {_maxdiff(a, c):.4g}, before {_maxdiff(b, c):.4g}", ""]


def _maxdiff(xs, ys) -> float:
    return max(float(np.abs(p.astype(np.float64) - q).max()) for p, q in zip(xs, ys))


def digit_detector():
    """(QDQ ONNX of dal's DigitDetector, int8_balanced / a2000, calibrated on MNIST scenes, with a
    free batch dimension; 64 of those 64x64 scenes as float32 numpy) -- also bench/npu.py's detector."""
    import dal
    from dal_examples.datasets.mnist_scenes import mnist_scenes
    from dal.prepare import set_quantizer_state
    from dal_examples.zoo_detection import DigitDetector, image_batches
    scenes = mnist_scenes("test", 64)
    qat = dal.prepare_qat(DigitDetector(), recipe="int8_balanced", hardware="a2000", example_inputs=(scenes.images[:4],))
    dal.calibrate(qat, image_batches(scenes, 32), num_batches=2, progress=False)
    set_quantizer_state(qat, "frozen")
    qat.eval()
    return dal.export_onnx(qat, (scenes.images[:4],), dynamic_batch=True), scenes.images.numpy()


def main(reps: int = 7) -> str:
    torch.set_num_threads(1)
    det, images = digit_detector()
    lines = ["# Fan-out and pass-through integer groups (bench/fan_out.py)", "",
             f"One thread each, {reps} interleaved runs (ResNet: {max(3, reps // 2)}), medians. "
             f"CPU: {cpu_flags()}. The machine is shared: absolute times swing, ratios less.", ""]
    lines += measure("DigitDetector int8_balanced / a2000, batch 32 (MNIST scenes 64x64)", det,
                     images[:32], reps)
    import integer_model  # bench/integer_model.py's ResNet-18 (random weights, calibrated)
    _, _, sess = integer_model.build(8)
    x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(7)).numpy()
    lines += measure("ResNet-18 int8_balanced / a2000, batch 8, 3x224x224", sess.model, x, max(3, reps // 2))
    text = "\n".join(lines)
    return write_result("fan_out.md", text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    print(main(ap.parse_args().reps))
