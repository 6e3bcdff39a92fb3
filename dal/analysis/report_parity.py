"""The report's parity table: a ``dal.verify`` ParityReport as rows a person can read at a glance.

One row per comparison, all in codes (LSBs of the tensor's own quantization scale):

* end to end, per output and pair (NPU reference vs torch, vs onnxruntime): the criterion of
  ``ParityReport.meets_criterion`` (>= 99.99 % of elements within 1 LSB, none beyond 2);
* end to end, every intermediate integer tensor (NPU vs onnxruntime, each on its own upstream
  values): informational, a near-tie flip cascades here by design (DESIGN.md, "Parity");
* layer by layer, NPU from onnxruntime's quantized inputs (``layers_forced``), and torch from the
  NPU's values (``torch_layers``): at most 1 LSB (the criterion), on at most 1e-5 of the codes
  (near-ties only; the design's bound, which the criterion leaves to the reader: shown here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..verification.report import LAYER_LSB, MAX_LSB, WITHIN, ParityReport

NEAR_TIE_FRACTION = 1e-5  # layer by layer: float vs integer engines differ on near-ties only
PAIRS = {"npu_vs_torch": "NPU reference vs torch QAT", "npu_vs_ort": "NPU reference vs onnxruntime"}


@dataclass
class ParityRow:
    view: str          # "end to end" / "layer by layer"
    compared: str
    what: str          # output name, or "N tensors" / "N quantizers"
    elements: int
    differ: int
    max_lsb: Optional[float]
    bound: str         # what is required of this row
    status: str        # "pass", "fail", "info", "pass (above 1e-5 of codes)"
    within: Optional[float] = None  # fraction within 1 LSB, where known

    @property
    def fraction(self) -> float:
        return self.differ / max(self.elements, 1)


def _layer_row(view: str, compared: str, unit: str, rows: list, layer_lsb: float = LAYER_LSB) -> ParityRow:
    elements = sum(r.elements for r in rows)
    differ = sum(r.differ for r in rows)
    worst = max((r.max_abs for r in rows), default=0.0)
    ok = worst <= layer_lsb
    status = "pass" if ok else "fail"
    if ok and differ > NEAR_TIE_FRACTION * max(elements, 1):
        status = "pass (above 1e-5 of codes)"
    n_diff = sum(1 for r in rows if r.differ)
    return ParityRow(view, compared, f"{len(rows)} {unit}, {n_diff} differ", elements, differ, worst,
                     f"<= {layer_lsb:g} LSB, <= 1e-5 of codes", status, None)


def parity_rows(rep) -> list[ParityRow]:
    """The rows described in the module docstring, end to end first."""
    rows = []
    for name, pairs in rep.outputs.items():
        for pair, a in pairs.items():
            ok = ParityReport.output_meets(a)
            bound = "identical (float output)" if a.lsb is None else \
                f">= {WITHIN:.2%} within 1 LSB, none > {MAX_LSB:g}"
            rows.append(ParityRow("end to end", PAIRS.get(pair, pair), name, a.elements, a.elements - a.identical,
                                  a.max_lsb, bound, "pass" if ok else "fail",
                                  a.within_one_lsb_fraction if a.lsb is not None else None))
    integer = getattr(rep, "integer", None)
    if integer is not None and integer.error is None:
        rows.append(ParityRow("end to end", "integer model (dal.convert) vs NPU reference",
                              f"outputs + {integer.tensors} quantized tensors", integer.elements + integer.codes,
                              integer.differ + integer.codes_differ, None, "identical",
                              "pass" if integer.identical else "fail", None))
    if rep.layers:
        elements = sum(r.elements for r in rep.layers)
        rows.append(ParityRow("end to end", "NPU reference vs onnxruntime",
                              f"{len(rep.layers)} intermediate tensors, {sum(1 for r in rep.layers if r.differ)} "
                              "differ", elements, sum(r.differ for r in rep.layers),
                              max((r.max_abs for r in rep.layers), default=0.0),
                              "none (a near-tie flip cascades)", "info", None))
    if rep.layers_forced:
        rows.append(_layer_row("layer by layer", "NPU reference from onnxruntime's inputs", "tensors",
                               rep.layers_forced))
    if rep.torch_layers:
        rows.append(_layer_row("layer by layer", "torch QAT from the NPU reference's values", "quantizers",
                               rep.torch_layers))
    return rows


def verdict(rep) -> tuple[str, str]:
    """(css class, sentence) of ``rep.meets_criterion()``, naming what failed, after the stable
    verdict ``rep.verdict()`` (integer model == NPU, layer by layer <= 1e-5 at 1 LSB), stated first."""
    css, text = _criterion(rep)
    first = rep.verdict_line() + ". " if hasattr(rep, "verdict_line") else ""
    return css, first + text


def _criterion(rep) -> tuple[str, str]:
    if rep.meets_criterion():
        extra = [r for r in parity_rows(rep) if r.status.startswith("pass (")]
        note = (" Layer by layer, more than 1e-5 of the codes differ by 1 LSB (" +
                "; ".join(f"{r.compared}: {r.differ}/{r.elements}" for r in extra) +
                "): more than near-ties, read the layer rows below." if extra else "")
        return ("warn" if extra else "pass"), ("Parity PASSES the exporter's criterion (ParityReport.meets_criterion): "
                                               f"outputs >= {WITHIN:.2%} within 1 LSB and none beyond {MAX_LSB:g}; "
                                               f"layer by layer within {LAYER_LSB:g} LSB." + note)
    rows = parity_rows(rep)
    failed = [r for r in rows if r.status == "fail"]
    text = ("Parity FAILS the exporter's criterion (ParityReport.meets_criterion): " +
            "; ".join(f"{r.view}, {r.compared} ({r.what}): {r.differ}/{r.elements} codes differ" +
                      (f", {100 * r.within:.2f}% within 1 LSB" if r.within is not None else "") +
                      f", max {_lsb(r.max_lsb)} LSB" for r in failed) + ".")
    layer = [r for r in rows if r.view == "layer by layer"]
    if layer and all(r.status == "pass" for r in layer) and all(r.view == "end to end" for r in failed):
        text += (" Layer by layer every layer agrees within 1 LSB on at most 1e-5 of its codes (" +
                 "; ".join(f"{r.compared}: {r.differ}/{r.elements}" for r in layer) +
                 "): the end-to-end differences are near-tie flips cascading through the network, not a layer "
                 "computing something else (a wrong layer shows in both views).")
    return "fail", text


def _lsb(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def differing_layers(rows: list, limit: int = 20) -> list[dict]:
    """The rows that differ, largest difference first, then most codes (for the detail table)."""
    bad = sorted((r for r in rows if r.differ), key=lambda r: (-r.max_abs, -r.differ))
    return [{"tensor": r.tensor, "node": f"{r.op_type} {r.node}", "differ": f"{r.differ}/{r.elements}",
             "max LSB": f"{r.max_abs:.3g}"} for r in bad[:limit]]
