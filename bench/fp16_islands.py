"""FP16 islands (``engines.vector.compute: fp16``) and 256-code tables in dal.npu: before / after,
interleaved in one run, one thread, batch 1, 224x224, random-weight EfficientNet-B0.

* a2000, "before": the same model prepared for the a2000 with the vector engine's ``compute``
  set back to fp32 (the file as it was: SiLU, Sigmoid and average pooling in float32, no Casts);
  "after": the a2000 as bundled (every float island between Cast(FLOAT16) -> Cast(FLOAT) round
  trips, 328 Casts); "after, numpy casts": the after file with dal.npu's float32 <-> float16
  Cast run by numpy's ``astype`` instead of torch's (ops_float.py ``_torch_cast``).
* a1000 with ``lut_activation``: every SiLU is ``DQ -> Sigmoid -> Mul -> Q``; "before" loads the
  file with the elementwise-chain table off (fused_codes.py ``_unary_chain``), "after" as is.

    python bench/fp16_islands.py            # writes bench/results/fp16_islands.md
"""
from __future__ import annotations

import argparse
import collections
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


def _export(hardware, recipe, size):
    import torchvision

    import dal
    from export_common import prepared, randomize_bn
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(weights=None)
    randomize_bn(model, 0)
    qat = prepared(model, torch.randn(2, 3, size, size), recipe, hardware, batches=2)
    return dal.export_onnx(qat, (torch.randn(1, 3, size, size),))


def _hardware_fp32():
    from dal.hardware import load_hardware
    d = load_hardware("a2000").to_dict()
    d["name"] = "a2000_fp32_vector"
    d["engines"]["vector"].pop("compute", None)
    return d


def _lut_recipe():
    import yaml
    with open(os.path.join(HERE, "..", "recipes", "int8_balanced.yaml")) as fh:
        rec = yaml.safe_load(fh)
    rec["name"], rec["replace"] = "int8_balanced+lut", ["lut_activation"]
    return rec


def _numpy_casts():
    """A context switching dal.npu's torch Cast path off (numpy astype)."""
    from dal.npu import ops_float

    class Ctx:
        def __enter__(self):
            self.keep, ops_float._HALF_PAIR = ops_float._HALF_PAIR, set()

        def __exit__(self, *a):
            ops_float._HALF_PAIR = self.keep
    return Ctx()


def _load_without_tables(proto):
    import dal.npu
    from dal.npu import fused_codes
    keep = fused_codes._unary_chain
    fused_codes._unary_chain = lambda g, n: None
    try:
        return dal.npu.load(proto, threads=1)
    finally:
        fused_codes._unary_chain = keep


def _kinds(sess) -> str:
    c = collections.Counter(getattr(s, "kind", "?") for s in sess.steps)
    return ", ".join(f"{v} {k}" for k, v in sorted(c.items()))


def main(reps: int, size: int) -> str:
    import dal.npu
    torch.set_num_threads(1)
    x = np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32)
    lines = [f"# FP16 islands and code tables in dal.npu (EfficientNet-B0, {size}x{size}, batch 1, one thread)", "",
             f"CPU: {cpu_flags()}", f"torch {torch.__version__}, numpy {np.__version__}; median of {reps} "
             "interleaved runs, ms", ""]
    before, after = _export(_hardware_fp32(), "int8_balanced", size), _export("a2000", "int8_balanced", size)
    sb, sa = dal.npu.load(before, threads=1), dal.npu.load(after, threads=1)
    feed = {sa.input_names[0]: x}
    numpy_casts = _numpy_casts()

    def after_numpy():
        with numpy_casts:
            sa.run(feed)
    med = interleaved_medians({"before": lambda: sb.run(feed), "after": lambda: sa.run(feed), "after, numpy casts": after_numpy},
                reps)
    casts = sum(n.op_type == "Cast" for n in after.graph.node)
    cast_ms = sum(r["ms"] for r in sa.profile(feed, repeat=3) if r["op"] == "Cast")
    lines += ["## a2000, int8_balanced: vector engine compute fp32 (before) vs fp16 (after)", "",
              "| file | Casts | steps | dal.npu ms | vs before |", "|---|---|---|---|---|",
              f"| before (compute: fp32) | 0 | {_kinds(sb)} | {med['before']:.1f} | 1.00x |",
              f"| after (compute: fp16) | {casts} | {_kinds(sa)} | {med['after']:.1f} | "
              f"{med['after'] / med['before']:.2f}x |",
              f"| after, numpy casts | {casts} | same | {med['after, numpy casts']:.1f} | "
              f"{med['after, numpy casts'] / med['before']:.2f}x |", "",
              f"The Casts' share of the after run (Session.profile): {cast_ms:.1f} ms.", ""]
    lut = _export("a1000", _lut_recipe(), size)
    new, old = dal.npu.load(lut, threads=1), _load_without_tables(lut)
    assert all((p == q).all() for p, q in zip(new.run(feed), old.run(feed))), "table and nodes differ"
    med = interleaved_medians({"nodes": lambda: old.run(feed), "tables": lambda: new.run(feed)}, reps)
    lines += ["## a1000, int8_balanced + lut_activation: DQ -> Sigmoid -> Mul -> Q node by node vs one table", "",
              "| load | steps | dal.npu ms | vs nodes |", "|---|---|---|---|",
              f"| node by node | {_kinds(old)} | {med['nodes']:.1f} | 1.00x |",
              f"| 256-code tables | {_kinds(new)} | {med['tables']:.1f} | {med['tables'] / med['nodes']:.2f}x |", "",
              "Outputs identical (asserted).", ""]
    return write_result("fp16_islands.md", "\n".join(lines))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    print(main(args.reps, args.size))
