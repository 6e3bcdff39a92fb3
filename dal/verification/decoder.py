"""dal.verify_decoder: dal.verify on a decoder's prefill and decode files in one call, one verdict.

The prefill file (dal.export_decoder) runs on the prompt; the decode file then runs one step on
what the prefill produced, as a host would feed it (export/SPEC.md §5f): the NPU reference's
prefill cache codes in slots ``0 .. P-1`` of an L-slot cache (the rest zero codes, masked), the
prompt's next token (argmax of the NPU reference's logits at the prompt's last position, lowest
index on ties) at position ``n`` (the prompt's length), slots ``>= n`` masked. Each file gets the
whole of :func:`dal.verify` (integer model vs NPU on every element, the KV cache outputs included;
onnxruntime and torch layer by layer; per-layer cosine against the float model), paired with
:func:`dal.export.decoder.decoder_step` of the model.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import onnx
import torch

from .codes import as_torch
from .inputs import VerifyInputError, load_onnx
from .report import ParityReport


@dataclass
class DecoderReport:
    """:func:`verify_decoder`'s result: ``prefill`` and ``decode`` are each file's
    :class:`ParityReport`; ``token`` / ``position`` the decode step's input. :meth:`verdict` is
    both files' verdicts (ParityReport.verdict) together."""

    prefill: ParityReport
    decode: ParityReport
    prompt_len: int
    token: int
    position: int

    def verdict(self) -> bool:
        """True iff the prefill's and the decode step's ParityReport.verdict() both pass."""
        return self.prefill.verdict() and self.decode.verdict()

    def verdict_line(self) -> str:
        """One sentence: the decoder's verdict and each file's."""
        def word(r: ParityReport) -> str:
            return "PASS" if r.verdict() else "FAIL"
        text = (f"DECODER VERDICT: {'PASS' if self.verdict() else 'FAIL'} (prefill {word(self.prefill)}, "
                f"decode {word(self.decode)})")
        first = next((f"{name}: {r.first_failure()}" for name, r in (("prefill", self.prefill), ("decode", self.decode))
                      if r.first_failure()), None)
        return text + (f"; first at fault: {first}" if first else "")

    def to_dict(self) -> dict:
        """Plain JSON values: ``verdict``, ``verdict_line``, the step's inputs and each file's
        ParityReport.to_dict() under ``prefill`` / ``decode``."""
        return {"verdict": self.verdict(), "verdict_line": self.verdict_line(), "prompt_len": self.prompt_len,
                "decode_token": self.token, "decode_position": self.position,
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}

    def __str__(self) -> str:
        rule = "=" * 78
        return "\n".join([
            f"dal.verify_decoder: a prompt of {self.prompt_len} token(s), then one decode step (token {self.token} "
            f"at position {self.position}, the cache filled from the prefill's own outputs)",
            self.verdict_line(), rule, "PREFILL", rule, str(self.prefill), rule,
            "DECODE (cache from the prefill)", rule, str(self.decode)])


def _meta(proto: onnx.ModelProto, path: str) -> dict:
    meta = {p.key: p.value for p in proto.metadata_props}
    if "dal.decoder.graph" not in meta:
        raise VerifyInputError(f"verify_decoder: {path} has no dal.decoder.* metadata; give the "
                               "(prefill, decode) files dal.export_decoder wrote")
    return meta


def decoder_inputs(prefill: onnx.ModelProto, decode: onnx.ModelProto, prompt, prefill_outputs: Optional[list] = None):
    """``(prefill inputs, decode inputs or None)`` as torch tensors in graph-input order.

    The prefill's: ``prompt`` right-padded with token 0 to P, positions ``0 .. P-1``, the causal
    mask with the padding masked. Given the prefill's outputs (``[logits, present codes ...]``,
    numpy), the decode step's: the next token (argmax at position ``n - 1``), position ``n``, the
    mask of slots ``0 .. n-1`` and the new key, and each ``past`` cache: the prefill's P entries in
    slots ``0 .. P-1``, zero codes after (module doc)."""
    from ..export.decoder import causal_mask

    pm, dm = _meta(prefill, "the prefill file"), _meta(decode, "the decode file")
    P, L = int(pm["dal.decoder.prompt_len"]), int(dm["dal.decoder.cache_len"])
    ids = torch.as_tensor(prompt, dtype=torch.long).reshape(-1)
    n = ids.numel()
    if not 1 <= n <= P:
        raise VerifyInputError(f"verify_decoder: the prompt has {n} tokens; the prefill graph takes 1 .. {P} "
                               "(prompt_len P)")
    if n >= L:
        raise VerifyInputError(f"verify_decoder: the prompt has {n} tokens, so the decode step's position {n} is "
                               f"outside the decode graph's cache of {L} slots (positions 0 .. {L - 1})")
    padded = torch.zeros(1, P, dtype=torch.long)
    padded[0, :n] = ids
    pre = (padded, torch.arange(P)[None], causal_mask(torch.arange(P)[None] < n, P, False))
    if prefill_outputs is None:
        return pre, None
    token = int(np.argmax(np.asarray(prefill_outputs[0])[0, n - 1]))
    past = []
    for codes in prefill_outputs[1:]:
        codes = np.asarray(codes)
        cache = np.zeros((*codes.shape[:2], L, *codes.shape[3:]), codes.dtype)  # float8 zeros: zero bits
        cache[:, :, :P] = codes
        past.append(as_torch(cache))
    dec = (torch.tensor([[token]]), torch.tensor([[n]]), causal_mask(torch.arange(L)[None] < n, 1, True), *past)
    return pre, dec


def verify_decoder(onnx_paths: Sequence, torch_model, prompt, *, onnxruntime: bool = True,
                   threads=None) -> DecoderReport:
    """dal.verify on a decoder: the prefill file on ``prompt``, then the decode file on one step
    fed from the prefill's own outputs (module doc); a :class:`DecoderReport` with both files'
    ParityReports (each printed as its own section, layer by layer, the KV cache included) and
    one verdict (both pass).

    Args:
        onnx_paths: ``(prefill file, decode file)`` as dal.export_decoder returned them (batch 1).
        torch_model: the prepared causal LM they were exported from; each file is paired with
            ``dal.export.decoder.decoder_step(torch_model, file)`` (the KV cache as codes).
        prompt: 1 .. P token ids (1-D, or ``[1, n]``), with ``n < L`` (the decode position).
        onnxruntime, threads: as :func:`dal.verify`.

    A file without ``dal.decoder.*`` metadata, a batch other than 1, or a prompt of the wrong
    length raises VerifyInputError naming it.

    Example:
        >>> pre, dec = dal.export_decoder(model, "tiny", prompt_len=8, cache_len=16)
        >>> report = dal.verify_decoder((pre, dec), model, ids[:6])
        >>> print(report); assert report.verdict()
    """
    from ..export.decoder import decoder_step
    from .api import verify_with_outputs

    paths = list(onnx_paths) if isinstance(onnx_paths, (tuple, list)) else None
    if paths is None or len(paths) != 2:
        raise VerifyInputError("verify_decoder: give onnx_paths = (prefill file, decode file), as dal.export_decoder "
                               f"returns them; got {onnx_paths!r}")
    protos = [p if isinstance(p, onnx.ModelProto) else load_onnx(p) for p in paths]
    names = [p.graph.name if isinstance(p, onnx.ModelProto) else os.fspath(p) for p in paths]
    for proto, name, want in zip(protos, names, ("prefill", "decode")):
        meta = _meta(proto, name)
        if meta["dal.decoder.graph"] != want:
            raise VerifyInputError(f"verify_decoder: {name} is a {meta['dal.decoder.graph']} graph, but position "
                                   f"{('prefill', 'decode').index(want)} of onnx_paths takes the {want} graph")
        if meta.get("dal.decoder.batch", "1") != "1":
            raise VerifyInputError(f"verify_decoder: {name} was exported for batch {meta['dal.decoder.batch']}; "
                                   "export with batch=1")
    pre_inputs, _ = decoder_inputs(protos[0], protos[1], prompt)
    pre_report, outs = verify_with_outputs(protos[0], decoder_step(torch_model, protos[0]), pre_inputs,
                                           onnxruntime, threads)
    pre_report.model = names[0]
    _, dec_inputs = decoder_inputs(protos[0], protos[1], prompt, outs)
    dec_report = verify_with_outputs(protos[1], decoder_step(torch_model, protos[1]), dec_inputs, onnxruntime,
                                     threads)[0]
    dec_report.model = names[1]
    return DecoderReport(pre_report, dec_report, int(torch.as_tensor(prompt).numel()), int(dec_inputs[0]),
                         int(dec_inputs[1]))
