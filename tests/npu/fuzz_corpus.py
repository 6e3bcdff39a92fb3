"""Structured mutations of QDQ files for the never-a-crash fuzzer (tests/npu/test_fuzz.py).

Each case is (name, model bytes, culprits): a mutation of one of a few base models the way a
broken exporter or a damaged file would look -- truncated initializers, wrong element types,
shapes one element off, negative and huge attributes, dangling and cyclic inputs, zero / NaN /
inf / negative scales, out-of-range or mistyped zero points, junk or out-of-range metadata.
``culprits`` are the names (node, tensor) an error message about the case must mention.

    python tests/npu/fuzz_corpus.py --per-kind 40     # a bigger corpus, run in a child process

Run through ``run_child``: the cases execute in a separate Python process that prints one line
per case, so a signal (segfault, abort) or a runaway allocation is seen by the parent, which
knows which case was running.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphs  # noqa: E402
from fuzz_decoder import (blocked_float_model, blocked_group_model, blocked_model, cache_model,  # noqa: E402
                          decoder_edge, embed_model)

FEEDS = {"mixed_u8": (1, 4, 16, 16), "mixed_s8": (1, 4, 16, 16), "conv": (1, 8, 12, 12),
         "gemm": (5, 40), "grid": (1, 8, 9, 2), "scatter": (24, 5),
         "blocked": (4, 32), "blocked_group": (4, 32), "blocked_float": (4, 32), "cache": (1, 2, 1, 8), "embed": (3, 8)}


def grid_model(seed=4):
    """export/SPEC.md §5b's float island with the grid as the graph input (float, so it can hold
    NaN: the feed does): DQ(uint8 codes) -> GridSample(bilinear, zeros) -> Q -> DQ, where the
    file's X is a constant (1, 4, 5, 6)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (1, 4, 5, 6)).astype(np.uint8), "x_codes"),
             numpy_helper.from_array(np.float32(0.02), "x_scale"), numpy_helper.from_array(np.uint8(128), "x_zp")]
    nodes = [helper.make_node("DequantizeLinear", ["x_codes", "x_scale", "x_zp"], ["x"], name="x_dq"),
             helper.make_node("GridSample", ["x", "grid"], ["y"], name="grid_sample", mode="linear",
                              padding_mode="zeros", align_corners=0),
             helper.make_node("QuantizeLinear", ["y", "x_scale", "x_zp"], ["y_q"], name="y_q"),
             helper.make_node("DequantizeLinear", ["y_q", "x_scale", "x_zp"], ["out"], name="y_dq")]
    graph = helper.make_graph(nodes, "grid", [helper.make_tensor_value_info("grid", TensorProto.FLOAT, [1, 8, 9, 2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def scatter_model(seed=5):
    """export/SPEC.md §5c's scatter-add group and §5d's gather on codes, the updates the graph
    input: Q(u) -> DQ, DQ(d codes) -> ScatterElements(add) -> Q -> DQ -> GatherElements -> Q -> DQ
    (the gather on the sum's scale and zero point), indices int64 initializers (negative too)."""
    rng = np.random.default_rng(seed)
    arr = [(rng.integers(0, 256, (6, 5)).astype(np.uint8), "d_codes"), (np.float32(0.05), "s"), (np.uint8(100), "z"),
           (rng.integers(0, 6, (24, 5)).astype(np.int64), "idx"), (np.float32(0.2), "s_y"), (np.uint8(20), "z_y"),
           (rng.integers(-6, 6, (3, 5)).astype(np.int64), "g_idx")]
    inits = [numpy_helper.from_array(a, n) for a, n in arr]
    mk = helper.make_node
    nodes = [mk("QuantizeLinear", ["upd", "s", "z"], ["u_q"], name="u_q"),
             mk("DequantizeLinear", ["u_q", "s", "z"], ["u"], name="u_dq"),
             mk("DequantizeLinear", ["d_codes", "s", "z"], ["d"], name="d_dq"),
             mk("ScatterElements", ["d", "idx", "u"], ["acc"], name="scatter_add", axis=0, reduction="add"),
             mk("QuantizeLinear", ["acc", "s_y", "z_y"], ["acc_q"], name="acc_q"),
             mk("DequantizeLinear", ["acc_q", "s_y", "z_y"], ["acc_f"], name="acc_dq"),
             mk("GatherElements", ["acc_f", "g_idx"], ["g"], name="gather", axis=0),
             mk("QuantizeLinear", ["g", "s_y", "z_y"], ["g_q"], name="g_q"),
             mk("DequantizeLinear", ["g_q", "s_y", "z_y"], ["out"], name="g_dq")]
    graph = helper.make_graph(nodes, "scatter", [helper.make_tensor_value_info("upd", TensorProto.FLOAT, [24, 5])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def base_models():
    return {"mixed_u8": graphs.mixed_model(seed=0, act="u8"),
            "mixed_s8": graphs.mixed_model(seed=1, act="s8"),
            "conv": graphs.conv_model(seed=2, act="s8"),
            "gemm": graphs.linear_model(seed=3, op="Gemm"),
            "grid": grid_model(),
            "scatter": scatter_model(),
            "blocked": blocked_model(), "blocked_group": blocked_group_model(), "blocked_float": blocked_float_model(),
            "cache": cache_model(),
            "embed": embed_model()}


def _copy(m):
    c = type(m)()
    c.CopyFrom(m)
    return c


def _init(m, name):
    return next(t for t in m.graph.initializer if t.name == name)


def _replace(m, name, arr):
    t = _init(m, name)
    t.CopyFrom(numpy_helper.from_array(np.asarray(arr), name))


def _consumers(m, name):
    return [n for n in m.graph.node if name in n.input]


def _culprits(m, tensor):
    """The tensor, its consumers and theirs (a DQ's bad input surfaces in the op it feeds)."""
    first = _consumers(m, tensor)
    return [tensor] + [n.name for n in first] + [c.name for n in first for o in n.output for c in _consumers(m, o)]


def _any_node(m):
    """A mutated attribute or input shape may surface downstream: any node's name will do."""
    return [f"{n.name!r}" for n in m.graph.node]


def _scales(m):
    """(initializer name) of every Q/DQ scale in the model."""
    return sorted({n.input[1] for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")})


def _zero_points(m):
    return sorted({n.input[2] for n in m.graph.node
                   if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2 and n.input[2]})


# ---- mutation kinds: each f(model, rng) -> (label, culprits) edits the model in place -------------

def truncate_initializer(m, rng):
    t = m.graph.initializer[rng.integers(len(m.graph.initializer))]
    arr = numpy_helper.to_array(t)
    raw = arr.tobytes()
    cut = int(rng.integers(0, max(1, len(raw))))
    dims = list(t.dims)
    t.ClearField("int32_data"), t.ClearField("float_data"), t.ClearField("int64_data")
    t.raw_data = raw[:cut]
    del t.dims[:]
    t.dims.extend(dims)
    return f"{t.name}[:{cut}]", _culprits(m, t.name)


def wrong_element_type(m, rng):
    t = m.graph.initializer[rng.integers(len(m.graph.initializer))]
    arr = numpy_helper.to_array(t)
    to = [np.float64, np.int32, np.float32, np.uint8, np.int8, np.int64, np.float16]
    to = to[rng.integers(len(to))]
    if rng.integers(2):  # keep the bytes, change the type tag: sizes disagree, or reinterpret
        t.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(to))
        if not t.raw_data:
            t.raw_data = arr.tobytes()
            t.ClearField("float_data"), t.ClearField("int32_data"), t.ClearField("int64_data")
    else:  # a well-formed tensor of the wrong type
        t.CopyFrom(numpy_helper.from_array(arr.astype(to), t.name))
    return f"{t.name}->{np.dtype(to)}", _culprits(m, t.name)


def shape_off_by_one(m, rng):
    cands = [t for t in m.graph.initializer if len(t.dims)]
    t = cands[rng.integers(len(cands))]
    arr = numpy_helper.to_array(t)
    ax = int(rng.integers(arr.ndim))
    if rng.integers(2) and arr.shape[ax] > 1:
        arr = np.take(arr, range(arr.shape[ax] - 1), axis=ax)
    else:
        arr = np.concatenate([arr, np.take(arr, [0], axis=ax)], axis=ax)
    _replace(m, t.name, np.ascontiguousarray(arr))
    # a consistent weight of another kernel size changes the shapes downstream: any node will do
    return f"{t.name} axis {ax} -> {arr.shape[ax]}", _culprits(m, t.name) + _any_node(m)


_BAD_INTS = [-1, -2, 0, -(1 << 31), 1 << 20, 1 << 30, (1 << 62), 3]


def bad_attribute(m, rng):
    cands = [(n, a) for n in m.graph.node for a in n.attribute
             if a.type in (helper.AttributeProto.INT, helper.AttributeProto.INTS)]
    n, a = cands[rng.integers(len(cands))]
    v = _BAD_INTS[rng.integers(len(_BAD_INTS))]
    if a.type == helper.AttributeProto.INT:
        a.i = v
    else:
        vals = list(a.ints) or [1]
        vals[rng.integers(len(vals))] = v
        if rng.integers(4) == 0:
            vals = vals + [v]  # one element too many
        del a.ints[:]
        a.ints.extend(vals)
    return f"{n.name}.{a.name}={v}", _any_node(m)


def dangling_input(m, rng):
    n = m.graph.node[rng.integers(len(m.graph.node))]
    i = int(rng.integers(len(n.input)))
    n.input[i] = "no_such_tensor"
    return f"{n.name}.input[{i}]", [n.name, "no_such_tensor"]


def cyclic_input(m, rng):
    k = int(rng.integers(len(m.graph.node)))
    later = m.graph.node[int(rng.integers(k, len(m.graph.node)))]
    n = m.graph.node[k]
    n.input[int(rng.integers(len(n.input)))] = later.output[0]
    return f"{n.name} reads {later.output[0]}", [n.name, later.name, "cycle"] + _any_node(m)


def bad_scale(m, rng):
    names = _scales(m)
    s = names[rng.integers(len(names))]
    arr = numpy_helper.to_array(_init(m, s)).copy()
    bad = [0.0, -1.0, np.nan, np.inf, -np.inf, -0.0][rng.integers(6)]
    flat = arr.reshape(-1)
    flat[rng.integers(flat.size)] = bad
    _replace(m, s, arr)
    return f"{s}={bad}", _culprits(m, s)


def bad_zero_point(m, rng):
    names = _zero_points(m)
    z = names[rng.integers(len(names))]
    arr = numpy_helper.to_array(_init(m, z))
    choice = int(rng.integers(3))
    if choice == 0:  # a zero point of another type than the codes
        new = arr.astype(np.int16) + np.int16(300)
    elif choice == 1:
        new = np.full(arr.shape, 1 << 20, dtype=np.int32)
    else:  # a per-channel zero point for a per-tensor scale, or the reverse
        new = np.repeat(arr.reshape(-1)[:1], 3)
    _replace(m, z, new)
    return f"{z} -> {new.dtype}{list(new.shape)}", _culprits(m, z)


_JUNK = ["{", "[]", "null", '"fixed_point"', '{"kind": "integer"}', '{"kind": "fixed_point", "multiplier_bits": 0}',
         '{"kind": "fixed_point", "multiplier_bits": 1e9}', '{"kind": "fixed_point", "rounding": "up"}',
         '{"kind": "fixed_point", "multiplier_bits": -5, "rounding": 3}', "\u0000\u00ff"]
_JUNK_SPARSE = ["{", '{"x": 1}', '{"no_such_init": 0}', '{"%s": 99}', '{"%s": "a"}', "[1, 2]"]


def junk_metadata(m, rng):
    if rng.integers(2):
        key, val = "dal.requantizer", _JUNK[rng.integers(len(_JUNK))]
    else:
        w = next((t.name for t in m.graph.initializer if t.name.startswith("w_")), m.graph.initializer[0].name)
        val = _JUNK_SPARSE[rng.integers(len(_JUNK_SPARSE))]
        key, val = "dal.sparse_24", val % w if "%s" in val else val
    helper.set_model_props(m, {key: val})
    return f"{key}={val!r}", ["dal.", "sparse initializer"]


def index_out_of_range(m, rng):
    """One index of a Gather / GatherElements / ScatterElements / ScatterND initializer set to n or
    -n - 1 (n its axis's size in the data); a model without one is left as it is."""
    cands = [(n, _init(m, n.input[1])) for n in m.graph.node
             if n.op_type in ("Gather", "GatherElements", "ScatterElements", "ScatterND") and len(n.input) > 1
             and any(t.name == n.input[1] for t in m.graph.initializer)]
    if not cands:
        return "no index initializer", []
    n, t = cands[rng.integers(len(cands))]
    arr = numpy_helper.to_array(t).copy()
    data = [d for d in m.graph.initializer if d.name == n.input[0]]
    axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
    size = data[0].dims[axis] if data else 6  # else the scatter base model's axis 0
    flat = arr.reshape(-1)
    flat[rng.integers(flat.size)] = size if rng.integers(2) else -size - 1
    _replace(m, t.name, arr)
    return f"{t.name} out of range", [n.name, t.name]


def graph_input_shape(m, rng):
    d = m.graph.input[0].type.tensor_type.shape.dim
    k = int(rng.integers(len(d)))
    d[k].dim_value = max(0, d[k].dim_value + (1 if rng.integers(2) else -1))
    return f"input dim {k} -> {d[k].dim_value}", [m.graph.input[0].name] + _any_node(m)


KINDS = {f.__name__: f for f in (truncate_initializer, wrong_element_type, shape_off_by_one,
                                  bad_attribute, dangling_input, cyclic_input, bad_scale,
                                  bad_zero_point, junk_metadata, graph_input_shape, index_out_of_range,
                                  decoder_edge)}
ONLY = {"decoder_edge": ("blocked", "blocked_group", "blocked_float", "cache", "embed")}  # kinds that apply to some base models only


def corpus(per_kind: int = 6, seed: int = 0):
    """[(case name, base model name, serialized model, culprits)], ``per_kind`` per mutation kind
    and base model pair, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    bases = base_models()
    out = []
    for kind, fn in KINDS.items():
        names = list(ONLY.get(kind, bases))
        for k in range(per_kind):
            bname = names[k % len(names)]
            m = _copy(bases[bname])
            label, culprits = fn(m, rng)
            out.append((f"{kind}/{bname}/{label}", bname, m.SerializeToString(), culprits))
    return out


# ---- child process: run the cases, one JSON line each -------------------------------------------

def _reference(model_bytes, x):
    """onnxruntime (no graph optimizations) on the same file, or None where it refuses it."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        s = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        return s.run(None, {s.get_inputs()[0].name: x})
    except Exception:
        return None


def _outcome(got, ref):
    """'clean' (agrees with onnxruntime, or onnxruntime refuses and the output is finite),
    else a description of how it is wrong."""
    if ref is None:
        return "clean" if all(np.all(np.isfinite(g)) for g in got if g.dtype.kind == "f") else "non-finite output"
    for g, r in zip(got, ref):
        if g.shape != r.shape or g.dtype != r.dtype:
            return f"shape/dtype {g.shape} {g.dtype} vs onnxruntime {r.shape} {r.dtype}"
        d = np.abs(g.astype(np.float64) - r.astype(np.float64))
        tol = 0.05 * float(np.nanmax(np.abs(r))) + 1e-6 if r.size else 0
        if r.size and np.mean(~(d <= tol)) > 0.05:  # a near-tie flip may cascade; garbage does not
            return f"differs from onnxruntime on {np.mean(~(d <= tol)):.0%} of elements"
    return "clean"


def child_main(per_kind: int, seed: int, limit_memory: bool = True, reference: bool = True):
    """Run the corpus in this process, one JSON line per case (start, then the outcome).
    AddressSanitizer runs pass ``limit_memory=False`` (its shadow memory needs the address space)
    and ``reference=False`` (onnxruntime's own C++ exceptions trip ASan's __cxa_throw
    interceptor: a clean run is then only checked for finite outputs)."""
    if limit_memory:
        import resource
        # a runaway allocation must fail fast, not swap the machine: 6 GiB of address space
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    import dal.npu as npu
    rng = np.random.default_rng(seed + 1)
    feeds = {b: rng.standard_normal(s).astype(np.float32) for b, s in FEEDS.items()}
    feeds["grid"].reshape(-1)[[0, 7, 30, 31]] = np.nan  # NaN coordinates sample 0.0 (export/SPEC.md §5b)
    for name, bname, data, culprits in corpus(per_kind, seed):
        print(json.dumps({"case": name, "state": "start"}), flush=True)
        x = feeds[bname]
        rec = {"case": name, "state": "done"}
        t0 = time.perf_counter()
        try:
            sess = npu.load(data)
            got = sess.run([x])
            rec["result"] = _outcome(got, _reference(data, x) if reference else None)
        except npu.NPUError as e:
            msg = str(e)
            rec["result"] = "named" if any(c in msg for c in culprits) else "unnamed"
            rec["message"] = msg[:300]
        except BaseException as e:  # noqa: BLE001 -- the fuzzer's job is to see these
            rec["result"] = f"exception {type(e).__name__}"
            rec["message"] = str(e)[:300]
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(rec), flush=True)


def run_child(per_kind: int = 6, seed: int = 0, env=None):
    """Run the corpus in a child process; returns (records, last started case, returncode)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--per-kind", str(per_kind),
           "--seed", str(seed)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    recs, last = [], None
    for line in p.stdout.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("state") == "start":
            last = r["case"]
        else:
            recs.append(r)
            last = None
    return recs, last, p.returncode, p.stderr[-2000:]


def summary(recs):
    from collections import Counter
    return Counter(r["result"] if r["result"] in ("named", "clean", "unnamed") else "bad" for r in recs)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--per-kind", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        child_main(args.per_kind, args.seed)
    else:
        recs, last, rc, err = run_child(args.per_kind, args.seed)
        for r in recs:
            if r["result"] not in ("named", "clean") or r["seconds"] > 1:
                print(r["result"], r["seconds"], "s", r["case"], r.get("message", ""))
        print(dict(summary(recs)), "cases:", len(recs), "returncode:", rc,
              f"died in: {last}" if last else "")
        if rc:
            print(err)
