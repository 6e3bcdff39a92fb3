"""The report's parity table: a ``dal.verify`` ParityReport as rows a person can read at a glance.

One verdict, ``ParityReport.verdict()`` (the one ``dal verify --strict`` and the printed report
use): the integer model (dal.convert) equals the NPU reference on every element, and every
layer-by-layer difference between a float engine and the NPU reference is a near-tie, tested code
by code (dal.verification.near_tie). The rows, all in codes (LSBs of the tensor's own scale):

* the integer model vs the NPU reference: must be identical (part of the verdict);
* layer by layer, NPU from onnxruntime's quantized inputs (``layers_forced``) and torch from the
  NPU's values (``torch_layers``): near-ties only (part of the verdict);
* end to end, per output and pair (NPU reference vs torch QAT, vs the torch float model, vs
  onnxruntime) and every intermediate integer tensor: reported with cosine, not part of the
  verdict (a near-tie flip cascades here by design, DESIGN.md "Parity").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PAIRS = {"npu_vs_torch": "NPU reference vs torch QAT", "npu_vs_ort": "NPU reference vs onnxruntime",
         "npu_vs_float": "NPU reference vs torch float model"}


@dataclass
class ParityRow:
    view: str          # "end to end" / "layer by layer" / "integer"
    compared: str
    what: str          # output name, or "N tensors" / "N quantizers"
    elements: int
    differ: int
    max_lsb: Optional[float]
    bound: str         # what is required of this row
    status: str        # "pass", "fail", "info" (reported, not part of the verdict)
    within: Optional[float] = None  # fraction within 1 LSB, where known
    cosine: Optional[float] = None  # float64 cosine (lowest of the rows summarised)
    near_ties: Optional[int] = None  # layer by layer: differing codes that are near-ties

    @property
    def fraction(self) -> float:
        return self.differ / max(self.elements, 1)


def _layer_row(compared: str, unit: str, rows: list) -> ParityRow:
    elements = sum(r.elements for r in rows)
    differ = sum(r.differ for r in rows)
    worst = max((r.max_abs for r in rows), default=0.0)
    n_diff = sum(1 for r in rows if r.differ)
    cos = [r.cosine for r in rows if r.cosine is not None]
    return ParityRow("layer by layer", compared, f"{len(rows)} {unit}, {n_diff} differ", elements, differ, worst,
                     "near-ties only (1 LSB within the float32 error bound of a boundary)",
                     "pass" if all(r.passes for r in rows) else "fail", None, min(cos) if cos else None,
                     sum(r.near_ties for r in rows))


def parity_rows(rep) -> list:
    """The rows described in the module docstring: the verdict's rows first, then the reported ones."""
    rows = []
    integer = getattr(rep, "integer", None)
    if integer is not None and integer.error is None:
        rows.append(ParityRow("integer", "integer model (dal.convert) vs NPU reference",
                              f"outputs + {integer.tensors} quantized tensors", integer.elements + integer.codes,
                              integer.differ + integer.codes_differ, None, "identical",
                              "pass" if integer.identical else "fail", None))
    elif integer is not None:
        rows.append(ParityRow("integer", "integer model (dal.convert) vs NPU reference", "not run", 0, 0, None,
                              "identical", "fail", None))
    if rep.layers_forced:
        rows.append(_layer_row("NPU reference from onnxruntime's inputs", "tensors", rep.layers_forced))
    if rep.torch_layers:
        rows.append(_layer_row("torch QAT from the NPU reference's values", "quantizers", rep.torch_layers))
    for name, pairs in rep.outputs.items():
        for pair, a in pairs.items():
            rows.append(ParityRow("end to end", PAIRS.get(pair, pair), name, a.elements, a.elements - a.identical,
                                  a.max_lsb, "reported (drift cascades from near-ties)", "info",
                                  a.within_one_lsb_fraction if a.lsb is not None else None, a.cosine))
    if rep.layers:
        elements = sum(r.elements for r in rep.layers)
        rows.append(ParityRow("end to end", "NPU reference vs onnxruntime",
                              f"{len(rep.layers)} intermediate tensors, {sum(1 for r in rep.layers if r.differ)} "
                              "differ", elements, sum(r.differ for r in rep.layers),
                              max((r.max_abs for r in rep.layers), default=0.0),
                              "reported (drift cascades from near-ties)", "info", None))
    return rows


def verdict(rep) -> tuple[str, str]:
    """(css class, sentence) of ``rep.verdict()``: the same verdict the printed report and
    ``dal verify --strict`` give, with what decided it and, on failure, the layer at fault."""
    return ("pass" if rep.verdict() else "fail"), rep.verdict_line()


def _lsb(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def differing_layers(rows: list, limit: int = 20) -> list:
    """The rows that differ, failures first, then largest difference, then most codes (detail table)."""
    bad = sorted((r for r in rows if r.differ), key=lambda r: (-r.failures, -r.max_abs, -r.differ))
    return [{"tensor": r.tensor, "layer": r.layer or "-", "node": f"{r.op_type} {r.node}",
             "differ": f"{r.differ}/{r.elements}", "near-ties": str(r.near_ties), "not near-ties": str(r.failures),
             "max LSB": f"{r.max_abs:.3g}", "cosine": "-" if r.cosine is None else f"{r.cosine:.6f}"}
            for r in bad[:limit]]
