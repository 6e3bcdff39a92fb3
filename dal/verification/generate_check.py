"""dal.generate_check: greedy decoding with the integer model and with dal.npu on the exported
prefill / decode graphs (dal.export_decoder), step by step, and the first step where they differ.

Both engines get the same inputs at every step: the prompt (right-padded to P, padding masked),
then each step's token, position and mask, and the KV cache as codes. The host side is this
module's: it writes the prefill's entries to cache slots ``0 .. P-1`` and the entry of the token
at position ``p`` to slot ``p``, masks slots not written yet (and padding), and feeds each engine
its own cache and its own next token (``argmax`` of the last valid position's logits, lowest index
on ties), so a difference shows at the step it arises. Both are integer engines: their logits and
cache codes must be identical on every element (export/SPEC.md, decoder graphs), compared bit for
bit (float32 logits by their bits, codes by value).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import onnx
import torch
from torch import nn

from .codes import as_numpy, as_torch


@dataclass
class StepDifference:
    """Where the engines first differ: ``prompt`` index, ``step`` (0 the prefill, k the k-th
    decode step), ``what`` (``tokens``, ``logits`` or an output name) and how many elements."""

    prompt: int
    step: int
    what: str
    differ: int
    elements: int

    def __str__(self) -> str:
        where = "prefill" if self.step == 0 else f"decode step {self.step}"
        return f"prompt {self.prompt}, {where}: {self.what} differ ({self.differ}/{self.elements} elements)"


@dataclass
class GenerateReport:
    """``first`` is None when the integer model and dal.npu gave identical tokens, logits and
    cache codes for every prompt and step; ``tokens_integer`` / ``tokens_npu`` hold each prompt's
    generated tokens; ``elements`` counts every compared element (logits and cache codes),
    ``differ`` those whose bits differ. A prompt's decoding stops where the tokens differ."""

    prompts: int
    steps: int
    first: Optional[StepDifference] = None
    elements: int = 0
    differ: int = 0
    tokens_integer: list = field(default_factory=list)
    tokens_npu: list = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.first is None and self.elements > 0

    def __str__(self) -> str:
        head = f"generate_check: {self.prompts} prompt(s), prefill + {self.steps} decode step(s), " \
               f"{self.differ} of {self.elements} elements differ: "
        return head + ("integer model == dal.npu on every token, logit and cache code" if self.first is None
                       else f"first difference at {self.first}")


def _meta(proto: onnx.ModelProto, key: str, path: str) -> str:
    meta = {p.key: p.value for p in proto.metadata_props}
    if key not in meta:
        raise ValueError(f"generate_check: {path} has no {key} metadata; give the files dal.export_decoder wrote")
    return meta[key]


def _differ(a: np.ndarray, b: np.ndarray) -> int:
    """Elements of ``a`` and ``b`` that are not the same bits (shapes must match)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape or a.dtype.itemsize != b.dtype.itemsize:
        return int(max(a.size, b.size))
    view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return int((a.view(view) != b.view(view)).sum())


def generate_check(model: nn.Module, onnx_paths: Sequence, prompts: Sequence, steps: int) -> GenerateReport:
    """Greedy decoding of ``prompts`` for ``steps`` tokens with ``dal.convert``'s integer model
    and with dal.npu on ``onnx_paths = (prefill file, decode file)`` of ``dal.export_decoder``;
    a :class:`GenerateReport` naming the first prompt / step / output where they differ (None).

    ``prompts``: 1-D int token tensors (or lists), each of length 1 .. P, decoded one at a time
    (the files' batch must be 1). ``len(prompt) + steps`` must not exceed the cache length L (the
    last token's position is ``len(prompt) + steps - 1 < L``). ValueError naming the prompt
    otherwise. A prompt's decoding goes on after a difference in logits or codes (each engine on
    its own cache) and stops where the two engines' tokens differ; later prompts still run.

    Example:
        >>> pre, dec = dal.export_decoder(model, "tiny", prompt_len=8, cache_len=16)
        >>> print(dal.generate_check(model, (pre, dec), [ids[:5], ids[5:13]], steps=8))
    """
    pre_path, dec_path = (str(p) for p in onnx_paths)
    pre, dec = onnx.load(pre_path), onnx.load(dec_path)
    prompt_len = int(_meta(pre, "dal.decoder.prompt_len", pre_path))
    cache_len = int(_meta(dec, "dal.decoder.cache_len", dec_path))
    batch = _meta(pre, "dal.decoder.batch", pre_path)
    if batch != "1":
        raise ValueError(f"generate_check: {pre_path} was exported for batch {batch}; export with batch=1")
    steps = int(steps)
    prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    for i, p in enumerate(prompts):
        if not 1 <= p.numel() <= prompt_len:
            raise ValueError(f"generate_check: prompt {i} has {p.numel()} tokens; the prefill graph takes 1 .. "
                             f"{prompt_len} (prompt_len P)")
        if p.numel() + steps > cache_len:
            raise ValueError(f"generate_check: prompt {i} ({p.numel()} tokens) + {steps} steps exceeds the decode "
                             f"graph's cache of {cache_len} slots")
    engines = _Engines(model, pre, dec, prompt_len, cache_len)
    report = GenerateReport(len(prompts), steps)
    for i, prompt in enumerate(prompts):
        engines.decode(i, prompt, steps, report)
    return report


def _blank_cache(new: torch.Tensor, length: int) -> torch.Tensor:
    shape = list(new.shape)
    shape[2] = length
    if new.dtype.is_floating_point:  # float8 codes: zero bits
        return torch.zeros(shape, dtype=torch.uint8).view(new.dtype)
    return torch.zeros(shape, dtype=new.dtype)


class _Engines:
    """Both engines on both graphs, and the host's loop (module docstring)."""

    def __init__(self, model, pre: onnx.ModelProto, dec: onnx.ModelProto, prompt_len: int, cache_len: int):
        import dal.npu
        from ..convert import convert
        from ..export.decoder_module import CodesStep, DecoderStep

        self.int_pre = convert(CodesStep(DecoderStep(model, cache_len, False)))
        self.int_dec = convert(CodesStep(DecoderStep(model, cache_len, True)))
        # one thread: a decode step's tensors are tiny, and a thread pool per node cost ~25 ms a
        # QuantizeLinear on a loaded 2-core machine (measured: 7.3 of 13.7 s of an 8-step check)
        self.npu_pre, self.npu_dec = dal.npu.load(pre, threads=1), dal.npu.load(dec, threads=1)
        self.names_pre, self.names_dec = [i.name for i in pre.graph.input], [i.name for i in dec.graph.input]
        self.out_names = [o.name for o in dec.graph.output]
        self.prompt_len, self.cache_len = prompt_len, cache_len
        self.device = next(model.parameters()).device

    def _int(self, int_model, inputs) -> list:
        """The integer model on its own device (the model's), results back on the CPU."""
        with torch.no_grad():
            return [t.cpu() for t in int_model(*[t.to(self.device) for t in inputs])]

    @staticmethod
    def _npu(sess, names, inputs) -> list:
        return sess.run(dict(zip(names, [as_numpy(t) for t in inputs])))

    def _compare(self, i, step, mine, theirs, last, report) -> tuple:
        """``(difference or None, token of the integer model, token of dal.npu)``; counts
        compared and differing elements into ``report``."""
        diff = None
        for name, a, b in zip(self.out_names, mine, theirs):
            d = _differ(as_numpy(a), np.asarray(b))
            report.elements += int(np.size(b))
            report.differ += d
            if d and diff is None:
                diff = StepDifference(i, step, name, d, int(np.size(b)))
        ti, tn = int(mine[0][0, last].argmax()), int(np.argmax(theirs[0][0, last]))
        if diff is None and ti != tn:
            diff = StepDifference(i, step, "tokens", 1, 1)
        return diff, ti, tn

    def decode(self, i: int, prompt: torch.Tensor, steps: int, report: GenerateReport) -> None:
        """Prefill and ``steps`` decode steps of prompt ``i`` on both engines, into ``report``."""
        from ..export.decoder import causal_mask

        n, P, L = prompt.numel(), self.prompt_len, self.cache_len
        ids = torch.zeros(1, P, dtype=torch.long)
        ids[0, :n] = prompt
        inputs = (ids, torch.arange(P)[None], causal_mask(torch.arange(P)[None] < n, P, False))
        mine, theirs = self._int(self.int_pre, inputs), self._npu(self.npu_pre, self.names_pre, inputs)
        # the host's cache, one per engine: prefill entries to slots 0..P-1, a decode entry to its position's
        caches = ([_blank_cache(t, L) for t in mine[1:]], [_blank_cache(t, L) for t in mine[1:]])
        toks = ([], [])
        for step in range(steps + 1):
            if step:
                pos = n + step - 1
                where = (torch.tensor([[pos]]), causal_mask(torch.arange(L)[None] < pos, 1, True))
                mine = self._int(self.int_dec, (torch.tensor([[toks[0][-1]]]), *where, *caches[0]))
                theirs = self._npu(self.npu_dec, self.names_dec, (torch.tensor([[toks[1][-1]]]), *where, *caches[1]))
            diff, ti, tn = self._compare(i, step, mine, theirs, n - 1 if step == 0 else 0, report)
            toks[0].append(ti)
            toks[1].append(tn)
            report.first = report.first or diff
            if ti != tn:  # the engines now decode different sequences: nothing more to compare
                break
            slots = slice(0, P) if step == 0 else slice(pos, pos + 1)
            for k in range(1, len(mine)):
                caches[0][k - 1][:, :, slots] = mine[k]
                caches[1][k - 1][:, :, slots] = as_torch(theirs[k])
        report.tokens_integer.append(toks[0])
        report.tokens_npu.append(toks[1])
