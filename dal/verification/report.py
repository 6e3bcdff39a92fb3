"""ParityReport: per output and per layer agreement of the NPU reference with torch and onnxruntime."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .metrics import Agreement

#: the exporter's parity criterion (``ParityReport.meets_criterion``'s defaults): outputs at least
#: WITHIN of their elements within 1 LSB and none beyond MAX_LSB; every layer-by-layer row within LAYER_LSB
WITHIN, MAX_LSB, LAYER_LSB = 0.9999, 2.0, 1.0
#: the verdict's layer-by-layer bound: float and integer engines differ on near-ties only
NEAR_TIE_FRACTION = 1e-5


@dataclass
class LayerParity:
    tensor: str
    node: str
    op_type: str
    elements: int
    differ: int
    max_abs: float


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

    def layer_by_layer(self) -> tuple[int, int, float]:
        """(codes differing, codes compared, max LSB) over both layer-by-layer views."""
        rows = list(self.layers_forced) + list(self.torch_layers)
        return (sum(r.differ for r in rows), sum(r.elements for r in rows),
                max((r.max_abs for r in rows), default=0.0))

    def verdict(self) -> bool:
        """The verdict ``dal verify --strict`` gates on, stable across inputs: the integer model
        (dal.convert) equals the NPU reference on every element, and layer by layer every code
        is within 1 LSB with at most 1e-5 of them off (near-ties). End-to-end drift of the float
        engines is not part of it (it cascades from near-ties by design). Without a torch model
        there is no integer model to compare: the layer-by-layer half alone decides."""
        if self.integer is not None and not self.integer.identical:
            return False
        differ, total, worst = self.layer_by_layer()
        return worst <= LAYER_LSB and differ <= NEAR_TIE_FRACTION * max(total, 1)

    def verdict_line(self) -> str:
        """The verdict in one sentence, and what decided it."""
        differ, total, worst = self.layer_by_layer()
        ok = self.verdict()
        parts = [("integer model == NPU on every element" if self.integer.identical else
                  f"{self.integer}") if self.integer is not None else
                 "integer model not checked (no torch model given)",
                 f"layer by layer {differ}/{total} codes differ, max {worst:g} LSB "
                 f"(allowed: <= {LAYER_LSB:g} LSB on <= {NEAR_TIE_FRACTION:g} of codes)"]
        return f"VERDICT: {'PASS' if ok else 'FAIL'}: " + "; ".join(parts)

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

    @staticmethod
    def output_meets(a: Agreement, within: float = WITHIN, max_lsb: float = MAX_LSB) -> bool:
        """One output pair's half of the criterion: a float output (no LSB) must match exactly."""
        if a.lsb is None:
            return not a.off_by_more
        return a.within_one_lsb_fraction >= within and (a.max_lsb or 0.0) <= max_lsb + 1e-6

    def meets_criterion(self, within: float = WITHIN, max_lsb: float = MAX_LSB, layer_lsb: float = LAYER_LSB) -> bool:
        """The exporter's parity criterion: for every output and every pair compared (NPU vs
        torch, NPU vs onnxruntime), at least ``within`` of the elements within 1 LSB of the
        output format and none beyond ``max_lsb``; every layer-by-layer row (NPU from
        onnxruntime's inputs, torch from the NPU's) within ``layer_lsb``. An output without a
        per-tensor LSB (a float output) must match exactly."""
        if not all(self.output_meets(a, within, max_lsb) for pairs in self.outputs.values() for a in pairs.values()):
            return False
        return self.max_layer_lsb_forced <= layer_lsb and self.max_torch_layer_lsb <= layer_lsb

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
        lines += [f"{'output':<16} {'pair':<13} {'elements':>9} {'identical':>9} {'1 LSB':>7} {'>1 LSB':>7} "
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
    """A one-line summary of a layer-by-layer comparison, its first divergence, the rows that differ."""
    differ = [row for row in rows if row.differ]
    worst = max((row.max_abs for row in rows), default=0.0)
    lines = [f"{title}: {len(rows)} {unit}, {len(differ)} differ, {sum(r.differ for r in differ)}/"
             f"{sum(r.elements for r in rows)} codes, max {worst:.3g} LSB"]
    if first:
        lines.append(f"first divergence layer by layer: {first}")
    return lines + _layer_lines(differ)


def _layer_lines(rows: list, limit: int = 10) -> list[str]:
    return [f"  {row.tensor} ({row.op_type} {row.node}): {row.differ}/{row.elements} differ, max abs {row.max_abs:.3g}"
            for row in rows[:limit]]


def _row(name: str, pair: str, a: Agreement) -> str:
    max_lsb = f"{a.max_lsb:.2f}" if a.max_lsb is not None else "-"
    return (f"{name[:16]:<16} {pair:<13} {a.elements:>9} {a.identical:>9} {a.off_by_one:>7} {a.off_by_more:>7} "
            f"{max_lsb:>8} {a.cosine:>9.6f} {a.psnr:>8.1f}")
