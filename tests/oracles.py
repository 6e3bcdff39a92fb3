"""The oracles dal's tests judge dal by, each written once (import them as ``from oracles import ...``).

Every function here is written from onnx, onnxruntime and numpy only: nothing imports ``dal``,
so a bug in dal's exporter, its NPU reference or its own parity counting (dal.verification,
dal.npu.compare) cannot also be a bug of the judge. What they read is the ONNX file (a
``ModelProto`` or a path) and plain arrays.

- ``run_ort`` / ``ort_session`` / ``ort_values``: onnxruntime, a separate implementation of the
  ONNX operators, with graph optimizations off (``ORT_DISABLE_ALL``). With optimizations on it
  fuses Q/DQ groups into its int8 kernels (QLinearConv, MLAS), which on CPUs without VNNI
  saturate u8 x s8 products in int16 (measured: 5853 of 32768 outputs of one conv off by up
  to 18 LSB) and are exact with VNNI, so they are not an oracle. One intra-op thread: the
  numbers do not depend on the machine's core count.
- ``run_reference`` / ``ref_values``: onnx.reference, the ONNX project's Python evaluator of its
  own spec (it has Q/DQ kernels from opset 19 only: ``raise_opset``). It casts float8 with
  ml_dtypes, so it is not independent of ml_dtypes; onnxruntime is.
- ``output_scale``: the LSB of a graph output, read from the file: the scale initializer of the
  DequantizeLinear that produces it (optionally through ops that only move values). Not the
  model's quantizer attribute, not dal.verification.output_lsb.
- ``lsb_diff`` / ``lsb_stats`` / ``lsb_figures``: the difference of two dequantized outputs in
  units of that scale, checked to lie on the grid (both sides are codes times the scale, so
  anything but an integer means they are not quantized alike, and fails loudly).
- ``compare_codes``: element-wise agreement of two sets of named code tensors (the
  QuantizeLinear outputs, ``q_names``), instead of dal.npu.compare.
"""
from __future__ import annotations

import fractions

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper


# ---------------------------------------------------------------- runners
def _serialized(model) -> "str | bytes":
    if isinstance(model, (str, Path)):
        return str(model)
    return model.SerializeToString()


def ort_session(model, threads: int = 1):
    """An onnxruntime CPU session of ``model`` (ModelProto or path), graph optimizations off."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = threads
    return ort.InferenceSession(_serialized(model), so, providers=["CPUExecutionProvider"])


def run_ort(model, feeds: dict) -> list[np.ndarray]:
    """Every graph output of ``model`` (ModelProto or path) by onnxruntime, optimizations off."""
    return ort_session(model).run(None, feeds)


def npu_equals_ort(model, feeds: dict) -> np.ndarray:
    """dal.npu's first output of ``model``, asserted equal to onnxruntime's (optimizations off)
    in dtype, shape and every element."""
    import dal.npu

    want = run_ort(model, feeds)[0]
    got = dal.npu.run(model, feeds)[0]
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    return got


def run_reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Every graph output of ``model`` by onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def all_tensor_names(model: onnx.ModelProto) -> list[str]:
    """Every tensor a node of the graph produces."""
    return [o for n in model.graph.node for o in n.output if o]


def q_names(model: onnx.ModelProto) -> list[str]:
    """The outputs of every QuantizeLinear: the codes."""
    return [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"]


def with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``model`` whose graph also outputs ``names`` (type left to the runtime)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for name in names:
        if name not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            have.add(name)
    return m


def raise_opset(model: onnx.ModelProto, minimum: int = 19) -> onnx.ModelProto:
    """onnx.reference has Q/DQ only from opset 19; int8 Q/DQ semantics are unchanged since 13."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for o in m.opset_import:
        if o.domain in ("", "ai.onnx") and o.version < minimum:
            o.version = minimum
    return m


def ort_values(model: onnx.ModelProto, feed: dict) -> dict[str, np.ndarray]:
    """{tensor name: value} of every tensor of the graph, by onnxruntime (optimizations off)."""
    sess = ort_session(with_outputs(model, all_tensor_names(model)))
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def ref_values(model: onnx.ModelProto, feed: dict) -> dict[str, np.ndarray]:
    """{tensor name: value} of every tensor of the graph, by onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    m = raise_opset(model)
    names = all_tensor_names(m)
    return dict(zip(names, ReferenceEvaluator(m).run(names, feed)))


# ---------------------------------------------------------------- the output LSB
# ops that only move or relabel values: the LSB of their output is the LSB of their input
_MOVES = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"}


def output_scale(model, k: int = 0, through_moves: bool = False) -> float:
    """Scale of the DequantizeLinear that produces graph output ``k`` (ModelProto or path): the
    output LSB. Fails unless the output comes straight from a per-tensor DequantizeLinear; with
    ``through_moves``, ops that only move values (Reshape, Transpose, ..., a one-input Concat)
    may stand between the two."""
    proto = onnx.load(str(model)) if isinstance(model, (str, Path)) else model
    made_by = {o: n for n in proto.graph.node for o in n.output}
    name = proto.graph.output[k].name
    node = made_by[name]
    while through_moves and (node.op_type in _MOVES or (node.op_type == "Concat" and len(node.input) == 1)):
        node = made_by[node.input[0]]
    assert node.op_type == "DequantizeLinear", f"output {name} comes from {node.op_type}, not a DQ"
    inits = {t.name: t for t in proto.graph.initializer}
    scale = numpy_helper.to_array(inits[node.input[1]])
    assert scale.size == 1, "per-tensor output quantizer expected"
    return float(scale.reshape(()))


# ---------------------------------------------------------------- differences in LSB
def lsb_diff(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """|a - b| / scale element-wise, as integers.

    Both are codes times ``scale``, so the quotient is an integer up to float rounding;
    anything else means the two are not on the same grid and fails loudly.
    """
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    d = np.abs(a.astype(np.float64) - b.astype(np.float64)) / scale
    r = np.rint(d)
    assert np.all(np.abs(d - r) < 1e-3), f"outputs are off the LSB grid: max |d - rint(d)| = {np.abs(d - r).max()}"
    return r.astype(np.int64)


@dataclass
class LSBStats:
    n: int
    counts: dict  # |difference| in LSB -> number of elements

    @property
    def within1(self) -> float:
        return sum(c for d, c in self.counts.items() if d <= 1) / self.n

    @property
    def max_lsb(self) -> int:
        return max(self.counts)

    def __str__(self):
        parts = ", ".join(f"{d} LSB: {c}" for d, c in sorted(self.counts.items()))
        return f"{self.n} elements ({parts}); within 1 LSB: {100 * self.within1:.4f}%"


def lsb_stats(a: np.ndarray, b: np.ndarray, scale: float) -> LSBStats:
    """Differences of two dequantized outputs in LSBs, counted exactly (see ``lsb_diff``)."""
    d = lsb_diff(a, b, scale)
    values, counts = np.unique(d, return_counts=True)
    return LSBStats(int(d.size), {int(v): int(c) for v, c in zip(values, counts)})


def lsb_figures(a: np.ndarray, b: np.ndarray, scale: float) -> tuple[float, int]:
    """(fraction of elements within 1 LSB, max difference in LSB)."""
    d = lsb_diff(a, b, scale)
    return float((d <= 1).mean()), int(d.max())


def merge(stats: dict) -> LSBStats:
    """One LSBStats of several (e.g. of every layer)."""
    counts, n = {}, 0
    for s in stats.values():
        n += s.n
        for d, c in s.counts.items():
            counts[d] = counts.get(d, 0) + c
    return LSBStats(n, counts)


def assert_lsb_parity(stats: LSBStats, label: str = "") -> None:
    """The INT8 criterion: >= 99.99% of elements within 1 LSB, none beyond 2 LSB."""
    assert stats.max_lsb <= 2 and stats.within1 >= 0.9999, f"{label}: {stats}"


# ---------------------------------------------------------------- codes, tensor by tensor
def _as_int_or_float(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind in "iu" or str(a.dtype) in ("int4", "uint4"):
        return a.astype(np.int64)
    return a.astype(np.float64)


def compare_codes(mine: dict, theirs: dict, names) -> dict:
    """Agreement of the tensors ``names`` of two {name: array} dicts, summed over the tensors:
    {"tensors", "elements", "differ", "max_lsb"}. Integer codes differ by |a - b| codes; float
    tensors (float8 codes) are compared for equality (NaN equals NaN) and count 0 in max_lsb.
    A name missing from either side, or a shape mismatch, fails."""
    elements = differ = max_lsb = 0
    for name in names:
        a, b = _as_int_or_float(mine[name]), _as_int_or_float(theirs[name])
        assert a.shape == b.shape, f"{name}: shapes differ: {a.shape} vs {b.shape}"
        if a.dtype == np.int64 and b.dtype == np.int64:
            d = np.abs(a - b)
            differ += int((d != 0).sum())
            max_lsb = max(max_lsb, int(d.max(initial=0)))
        else:
            differ += int((~((a == b) | (np.isnan(a) & np.isnan(b)))).sum())
        elements += int(a.size)
    return {"tensors": len(names), "elements": elements, "differ": differ, "max_lsb": max_lsb}


def nearest_float(exact: fractions.Fraction, dtype) -> np.ndarray:
    """``exact`` rounded to ``dtype``, to nearest, ties to even (a sum of two floats can be a tie):
    float(exact) and its neighbours, compared exactly."""
    f = np.asarray(float(exact)).astype(dtype)
    cands = [np.asarray(c, dtype) for c in (np.nextafter(f, dtype(-np.inf)), f, np.nextafter(f, dtype(np.inf)))]
    dist = [abs(fractions.Fraction(float(c)) - exact) for c in cands]
    best = [c for c, d in zip(cands, dist) if d == min(dist)]
    uint = np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint16
    return next((c for c in best if int(c.view(uint)) % 2 == 0), best[0])[()]
