"""bench/llm_npu.py's functions run end to end on a 1-layer random tiny Llama (2 repetitions, no
timing assertions): the engines it times exist, take its inputs, and agree where they must."""
import os
import sys

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
T = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import llm_npu  # noqa: E402


def test_bench_runs_one_layer(tmp_path):
    torch.manual_seed(0)
    fp, _ = llm_npu.float_model(layers=1)
    calib = [torch.randint(0, 256, (1, llm_npu.PROMPT), generator=torch.Generator().manual_seed(1))]
    q = llm_npu.prepared(fp, llm_npu.PROMPT, calib)
    e = llm_npu.Engines(fp, q, str(tmp_path), prompt_len=8, cache_len=16)  # small: the bench uses 128 / 256
    wall, cpu = llm_npu.timed(e.runs(), reps=2)
    assert set(wall) == set(cpu) == set(e.runs())
    assert "model.layers.0.mlp.down_proj.weight_quant/DequantizeLinear" in llm_npu.constant_dequantizers(e.dec_path)
    # the thing timed is the real step: dal.npu's decode codes equal the integer model's, bit for bit
    npu = e.npu_dec.run(e.dec_np)
    mine = e.stepped(e.int_dec, e.dec_in)
    assert e.captured_same  # the captured integer models (compile_blocks("")) time the same outputs
    assert np.array_equal(npu[0].view(np.uint32), mine[0].numpy().view(np.uint32))
    for a, b in zip(npu[1:], mine[1:]):
        assert np.array_equal(a, b.numpy())
    # the float decode keeps its cache at P entries across steps
    e.float_decode()
    assert e.kv.get_seq_length() == 8
    assert llm_npu.by_op([{"op": "MatMul", "ms": 3.0}, {"op": "MatMul", "ms": 1.0}, {"op": "Add", "ms": 4.0}]) == \
        [("MatMul", 2, 4.0, 0.5), ("Add", 1, 4.0, 0.5)]


def test_results_file_keeps_what_the_bench_did_not_write():
    """bench/llm_npu.py rewrites only its own part of bench/results/llm_npu.md: a file from before the
    markers keeps everything from its first heading that is not the bench's own; a marked file keeps
    what lies before and after the markers, run after run."""
    gen = "# Title\n\ntable 1\n" + llm_npu.NOTES
    legacy = "# Title\n\nold table\n\n## Hand notes\n\nkeep me\n\n## 2026-12-05: dated\n\nkeep me too\n"
    once = llm_npu.merged(legacy, gen)
    assert "old table" not in once and "table 1" in once
    assert once.endswith("## Hand notes\n\nkeep me\n\n## 2026-12-05: dated\n\nkeep me too\n")
    assert once.startswith(llm_npu.BEGIN) and once.count(llm_npu.END) == 1
    edited = "intro by hand\n" + once + "\n## 2026-12-06: appended\n\nnew\n"
    twice = llm_npu.merged(edited, gen.replace("table 1", "table 2"))
    assert twice == edited.replace("table 1", "table 2")
    # the bench's own NOTES heading in a legacy file is not kept twice
    assert llm_npu.merged(gen, gen).count(llm_npu.NOTES.strip().splitlines()[0]) == 1
