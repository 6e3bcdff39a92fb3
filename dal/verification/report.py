"""ParityReport: per output and per layer agreement of the NPU reference with torch and onnxruntime."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from .metrics import Agreement

@dataclass
class LayerParity:
    """One quantized tensor compared layer by layer (or end to end, in ``layers``): ``differ``
    codes differ, by at most ``max_abs``. Layer-by-layer rows also say how many differing codes
    are near-ties (``near_ties``) and how many are not (``failures = differ - near_ties``: the row fails when > 0;
    ``note`` says why, e.g. the op without an error model), which ``layer`` computed the
    tensor (layer_verdict.layer_of), ``cosine``: float64 cosine of the two engines' dequantized
    tensors, and ``float_cosine``: float64 cosine of the NPU reference's dequantized values at this
    point, ``(code - zp) * s``, with the torch float model's (every quantizer off) value at the same
    quantizer, run end to end on the same inputs (layer_verdict.annotate_float): the vendor flow's
    per-layer consistency figure, quantization error included. Neither cosine is part of the
    verdict: only the codes (``differ``, ``near_ties``) decide it."""

    tensor: str
    node: str
    op_type: str
    elements: int
    differ: int
    max_abs: float
    near_ties: int = 0
    note: str = ""
    layer: str = ""
    cosine: Optional[float] = None
    float_cosine: Optional[float] = None

    def to_dict(self) -> dict:
        """The row's fields, plus ``failures``, as plain JSON values (non-finite floats as strings)."""
        return _plain({**dataclasses.asdict(self), "failures": self.failures})

    @property
    def failures(self) -> int:
        """Differing codes not shown to be near-ties (a row nobody judged counts all of them)."""
        return self.differ - self.near_ties

    @property
    def passes(self) -> bool:
        """Every differing code is a near-tie (near_tie.py)."""
        return self.failures == 0


@dataclass
class ParityReport:
    """``outputs[name] = {"npu_vs_torch": Agreement, "npu_vs_ort": Agreement}``; ``layers`` lists
    every intermediate integer tensor compared between the NPU reference and onnxruntime, in graph
    order, each engine running on its own upstream values; ``first_divergence`` names the first
    node whose output differs (None when all agree). ``layers_forced`` / ``first_forced_divergence``
    are the same comparison with onnxruntime's integer tensors substituted for the NPU's own as it
    runs, so each row is one layer's agreement from the same quantized inputs (a near-tie
    upstream cannot cascade into it). ``torch_layers``: each activation quantizer of the torch
    model against the NPU reference's codes, torch teacher-forced to the NPU's values."""

    model: str
    requantizer: str
    outputs: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    first_divergence: Optional[str] = None
    layers_forced: list = field(default_factory=list)
    first_forced_divergence: Optional[str] = None
    torch_layers: list = field(default_factory=list)
    integer: Optional[object] = None  # IntegerParity (integer_model.py): dal.convert vs the NPU

    order: dict = field(default_factory=dict)  # QuantizeLinear node name -> graph index (first_failure)

    def layer_by_layer(self) -> tuple[int, int, float]:
        """(codes differing, codes compared, max LSB) over both layer-by-layer views."""
        rows = self.layer_rows()
        return (sum(r.differ for r in rows), sum(r.elements for r in rows),
                max((r.max_abs for r in rows), default=0.0))

    def layer_rows(self) -> list:
        """Both layer-by-layer views (onnxruntime's inputs, torch teacher-forced), in graph order."""
        rows = list(self.layers_forced) + list(self.torch_layers)
        return sorted(rows, key=lambda r: self.order.get(r.node, len(self.order)))

    def near_tie_counts(self) -> tuple[int, int]:
        """(near-ties, failures) over both layer-by-layer views: differing codes that are / are not near-ties."""
        rows = self.layer_rows()
        return sum(r.near_ties for r in rows), sum(r.failures for r in rows)

    def first_failure(self) -> Optional[str]:
        """The first layer, in graph order, whose own computation differs: the first failing
        layer-by-layer row, named by the layer that computed it; else, when only the integer
        model differs, its first differing tensor. None when the verdict passes."""
        bad = [r for r in self.layer_rows() if not r.passes]
        if bad:
            r = bad[0]
            engine = "torch QAT" if r.tensor.endswith("(torch)") else "onnxruntime"
            why = f"; {r.note}" if r.note else ""
            return (f"layer {r.layer or r.node}: {r.failures} of its {r.elements} output codes differ between the NPU "
                    f"reference and {engine} beyond near-ties (max {r.max_abs:g} LSB, at {r.node}){why}")
        if self.integer is not None and not self.integer.identical:
            return f"integer model vs NPU: {self.integer.first or self.integer.error or 'layer groups differ'}"
        return None

    def verdict(self) -> bool:
        """THE parity verdict (``meets_criterion``, ``dal verify --strict``, the printed report
        and the HTML report all read it): the integer model (dal.convert) equals the NPU
        reference on every element of every output and quantized tensor, with the same integer
        groups, AND in both layer-by-layer views (NPU from onnxruntime's codes; torch
        teacher-forced to the NPU's) every differing code is a near-tie: exactly 1 LSB, its exact
        value within the float32 accumulation-error bound of the boundary between the two codes
        (near_tie.py states the bound); behind an FP16 island's float16 rounding, both codes
        within that bound of the exact value (layer_verdict.py). End-to-end drift of the float engines is reported
        (LSB counts, cosine) and does not decide it. Without a torch model there is no integer
        model: the layer-by-layer half alone decides."""
        if self.integer is not None and not self.integer.identical:
            return False
        return all(r.passes for r in self.layer_rows())

    def meets_criterion(self) -> bool:
        """The same verdict as :meth:`verdict` (one criterion; kept for callers that use this name)."""
        return self.verdict()

    def verdict_line(self) -> str:
        """The verdict in one sentence, what decided it and, on failure, the first layer at fault."""
        differ, total, worst = self.layer_by_layer()
        near, fail = self.near_tie_counts()
        parts = [("integer model == NPU on every element" if self.integer.identical else
                  f"{self.integer}") if self.integer is not None else
                 "integer model not checked (no torch model given)",
                 f"layer by layer {differ}/{total} codes differ, {near} near-ties, {fail} not near-ties "
                 f"(max {worst:g} LSB; allowed: near-ties only)"]
        text = f"VERDICT: {'PASS' if self.verdict() else 'FAIL'}: " + "; ".join(parts)
        first = self.first_failure()
        return text + (f"; first at fault: {first}" if first else "")

    def diagnosis(self) -> Optional[str]:
        """One line: when the float QAT model and the NPU differ end to end, whether the integer
        model explains it (near-tie cascade) or not (a real discrepancy, with its first layer)."""
        pairs = [a for p in self.outputs.values() for k, a in p.items() if k == "npu_vs_torch"]
        off = sum(a.elements - a.identical for a in pairs)
        if not pairs or self.integer is None or self.integer.error:
            return None
        if off == 0 and self.integer.identical:
            return "diagnosis: the float QAT model, the integer model and the NPU agree on every output element"
        worst = max((a.max_lsb or 0.0 for a in pairs), default=0.0)
        if self.integer.identical:
            return (f"diagnosis: near-tie cascade: the float QAT model differs from the NPU on {off} output "
                    f"elements (max {worst:.3g} LSB) but the integer model equals the NPU on every element: "
                    "float32 sums round a few near-tie codes the other way and later layers amplify them")
        return f"diagnosis: real discrepancy between the integer model and the NPU: first at {self.integer.first}"

    def to_dict(self) -> dict:
        """The whole report as plain JSON values (``json.dumps(report.to_dict(), allow_nan=False)``
        works; a non-finite float such as an infinite PSNR is the string ``"inf"``): ``verdict``,
        ``verdict_line``, ``outputs`` (pair -> Agreement fields), the three row lists
        (:meth:`LayerParity.to_dict`: LSB counts with ``cosine`` and ``float_cosine`` beside them)
        and ``integer``. Cosines are reported, not part of the verdict."""
        integer = None if self.integer is None else {**dataclasses.asdict(self.integer),
                                                     "identical": self.integer.identical}
        return _plain({"model": self.model, "requantizer": self.requantizer, "verdict": self.verdict(),
                       "verdict_line": self.verdict_line(),
                       "outputs": {name: {pair: dataclasses.asdict(a) for pair, a in pairs.items()}
                                   for name, pairs in self.outputs.items()},
                       "first_divergence": self.first_divergence,
                       "first_forced_divergence": self.first_forced_divergence,
                       "layers": [r.to_dict() for r in self.layers],
                       "layers_forced": [r.to_dict() for r in self.layers_forced],
                       "torch_layers": [r.to_dict() for r in self.torch_layers], "integer": integer})

    @property
    def max_torch_layer_lsb(self) -> float:
        """Largest code difference between a torch quantizer and the NPU reference, layer by layer."""
        return max((row.max_abs for row in self.torch_layers), default=0.0)

    @property
    def max_layer_lsb_forced(self) -> float:
        """Largest code difference of any layer run from onnxruntime's quantized inputs (0 when all agree)."""
        return max((row.max_abs for row in self.layers_forced), default=0.0)

    @property
    def bit_exact_vs_ort(self) -> bool:
        return all(a["npu_vs_ort"].identical == a["npu_vs_ort"].elements for a in self.outputs.values()
                   if "npu_vs_ort" in a) and not any(row.differ for row in self.layers)

    def __str__(self) -> str:
        lines = [f"dal.verify: {self.model} (requantizer: {self.requantizer})", self.verdict_line()]
        if self.diagnosis():
            lines.append(self.diagnosis())
        if self.integer is not None:
            lines.append(str(self.integer))
        lines += ["end to end (reported, not part of the verdict: a near-tie flip cascades):",
                  f"{'output':<16} {'pair':<13} {'elements':>9} {'identical':>9} {'1 LSB':>7} {'>1 LSB':>7} "
                  f"{'max LSB':>8} {'cosine':>9} {'PSNR dB':>8}"]
        for name, pairs in self.outputs.items():
            for pair, a in pairs.items():
                lines.append(_row(name, pair, a))
        differing = [row for row in self.layers if row.differ]
        lines.append(f"layers: {len(self.layers)} quantized intermediate tensors compared with onnxruntime, "
                     f"{len(differing)} differ")
        if self.first_divergence:
            lines.append(f"first divergence: {self.first_divergence}")
        lines += _layer_lines(differing)
        if self.layers_forced:
            lines += _layer_view("layer by layer (from onnxruntime's quantized inputs)", "tensors",
                                 self.layers_forced, self.first_forced_divergence)
        if self.torch_layers:
            lines += _layer_view("torch vs NPU layer by layer (torch fed the NPU's quantized values)", "quantizers",
                                 self.torch_layers, None)
        return "\n".join(lines)


def _layer_view(title: str, unit: str, rows: list, first) -> list[str]:
    """A one-line summary of a layer-by-layer comparison (near-ties and failures counted), its first
    divergence, the rows that differ; then every row: codes differing, max LSB, and beside them
    the cosines (float64, dequantized; reported, not part of the verdict): vs the other engine
    and vs the float model (quantizers off)."""
    differ = [row for row in rows if row.differ]
    worst = max((row.max_abs for row in rows), default=0.0)
    near, fail = sum(r.near_ties for r in rows), sum(r.failures for r in rows)
    lines = [f"{title}: {len(rows)} {unit}, {len(differ)} differ, {sum(r.differ for r in differ)}/"
             f"{sum(r.elements for r in rows)} codes ({near} near-ties, {fail} not), max {worst:.3g} LSB"]
    if first:
        lines.append(f"first divergence layer by layer: {first}")
    lines += _layer_lines(differ)
    wt = max([len("tensor")] + [len(r.tensor) for r in rows])  # whole names: every row identifiable
    wl = max([len("layer")] + [len(r.layer) for r in rows])
    lines.append(f"  {'tensor':<{wt}} {'layer':<{wl}} {'differ':>13} {'max LSB':>7} {'cosine':>10} {'vs float':>10}")
    lines += [f"  {row.tensor:<{wt}} {row.layer:<{wl}} {f'{row.differ}/{row.elements}':>13} "
              f"{row.max_abs:>7.3g} {_cos(row.cosine):>10} {_cos(row.float_cosine):>10}" for row in rows]
    return lines


def _plain(v):
    """``v`` with tuples as lists and non-finite floats as strings ("inf", "nan"): strict JSON."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _cos(v) -> str:
    return "-" if v is None else f"{v:.6f}"


def _layer_lines(rows: list, limit: int = 10) -> list[str]:
    out = []
    for row in rows[:limit]:
        judged = (f", {row.near_ties} near-ties, {row.failures} not" + (f" ({row.note})" if row.note else "")
                  if row.layer or row.near_ties else "")
        out.append(f"  {row.tensor} ({row.op_type} {row.node}{', layer ' + row.layer if row.layer else ''}): "
                   f"{row.differ}/{row.elements} differ, max abs {row.max_abs:.3g}{judged}")
    return out


def _row(name: str, pair: str, a: Agreement) -> str:
    max_lsb = f"{a.max_lsb:.2f}" if a.max_lsb is not None else "-"
    return (f"{name[:16]:<16} {pair:<13} {a.elements:>9} {a.identical:>9} {a.off_by_one:>7} {a.off_by_more:>7} "
            f"{max_lsb:>8} {a.cosine:>9.6f} {a.psnr:>8.1f}")
