"""Deployed perplexity of a calibrated / trained tiny Llama: held-out perplexity computed from the
INTEGER model (``dal.convert`` of the prefill step that ``dal.export_decoder`` exports), and a
bit-for-bit comparison of that integer model with dal.npu running the exported prefill graph.

The integer model is driven as dal/verification/generate_check.py drives it: the prefill step
``CodesStep(DecoderStep(model, L, decode=False))`` with ``P = L`` = the window length, every
position valid (``causal_mask``), positions ``0 .. P-1``; its first output is the logits
``[B, P, V]``. Each held-out window is one prefill; the perplexity is
``exp(sum of -log softmax(logits)[next token] / count)`` over all windows, in float64, as
bench/llm_common.perplexity scores the fake-quantized model (first token of each window unpredicted).
"""
from __future__ import annotations

import math
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

import llm_common as L  # bench/llm_common.py


def _inputs(ids: torch.Tensor) -> tuple:
    from dal.export.decoder import causal_mask

    b, p = ids.shape
    return ids, torch.arange(p)[None].expand(b, p).contiguous(), causal_mask(torch.ones(b, p, dtype=torch.bool), p, False)


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    lg = logits[:, :-1].double()
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item(), ids[:, 1:].numel()


@torch.no_grad()
def deployed_perplexity(model, held: torch.Tensor, windows: int | None = None, npu_windows: int = 0,
                        batch: int = 8) -> dict:
    """``{"ppl", "windows", "of", "npu_windows", "npu_positions", "npu_logits", "npu_differ"}``: the
    integer model's held-out perplexity over the first ``windows`` (all when None) consecutive
    ``L.SEQ``-token windows of ``held`` (``of`` them in all), and, on the first ``npu_windows`` of them, how many logits
    (of ``npu_logits`` compared, over ``npu_positions`` positions) dal.npu on the exported prefill
    graph (``dal.export_decoder(model, ..., prompt_len=L.SEQ, cache_len=L.SEQ)``) gives with
    other bits than the integer model (must be 0). ``model`` must carry a kv_cache rule's quantizers."""
    import dal
    import dal.npu
    from dal.convert import convert
    from dal_examples.datasets import text
    from dal.export.decoder_module import CodesStep, DecoderStep

    model.eval()
    integer = convert(CodesStep(DecoderStep(model, L.SEQ, False)))
    rows = text.blocks(held, L.SEQ)
    total = len(rows)
    if windows is not None:
        rows = rows[:windows]
    npu_windows = min(npu_windows, len(rows))
    nll, count = 0.0, 0
    out = {"windows": len(rows), "of": total, "npu_windows": npu_windows, "npu_positions": 0, "npu_logits": 0, "npu_differ": 0}
    if npu_windows:
        with tempfile.TemporaryDirectory() as tmp:
            pre, _ = dal.export_decoder(model, os.path.join(tmp, "tiny"), prompt_len=L.SEQ, cache_len=L.SEQ)
            import onnx

            names = [i.name for i in onnx.load(pre).graph.input]
            sess = dal.npu.load(pre, threads=1)
            for i in range(npu_windows):  # batch 1: the exported graph's batch
                x = rows[i: i + 1]
                args = _inputs(x)
                mine = integer(*args)[0]
                theirs = np.asarray(sess.run(dict(zip(names, [a.numpy() for a in args])))[0])
                a = np.ascontiguousarray(mine.numpy()).view(np.uint32)
                out["npu_differ"] += int((a != np.ascontiguousarray(theirs.astype(np.float32)).view(np.uint32)).sum())
                out["npu_logits"] += int(a.size)
                out["npu_positions"] += int(x.shape[1])
                n, c = _nll(mine, x)
                nll, count = nll + n, count + c
    for i in range(npu_windows, len(rows), batch):
        x = rows[i: i + batch]
        n, c = _nll(integer(*_inputs(x))[0], x)
        nll, count = nll + n, count + c
    out["ppl"] = math.exp(nll / count)
    return out
