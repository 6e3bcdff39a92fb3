"""ParityReport: per output and per layer agreement of the NPU reference with torch and onnxruntime."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .metrics import Agreement


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
    order; ``first_divergence`` names the first node whose output differs (None when all agree)."""

    model: str
    requantizer: str
    outputs: dict = field(default_factory=dict)
    layers: list = field(default_factory=list)
    first_divergence: Optional[str] = None

    @property
    def bit_exact_vs_ort(self) -> bool:
        return all(a["npu_vs_ort"].identical == a["npu_vs_ort"].elements for a in self.outputs.values()
                   if "npu_vs_ort" in a) and not any(row.differ for row in self.layers)

    def __str__(self) -> str:
        lines = [f"dal.verify: {self.model} (requantizer: {self.requantizer})",
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
        for row in differing[:10]:
            lines.append(f"  {row.tensor} ({row.op_type} {row.node}): {row.differ}/{row.elements} differ, "
                         f"max abs {row.max_abs:.3g}")
        return "\n".join(lines)


def _row(name: str, pair: str, a: Agreement) -> str:
    max_lsb = f"{a.max_lsb:.2f}" if a.max_lsb is not None else "-"
    return (f"{name[:16]:<16} {pair:<13} {a.elements:>9} {a.identical:>9} {a.off_by_one:>7} {a.off_by_more:>7} "
            f"{max_lsb:>8} {a.cosine:>9.6f} {a.psnr:>8.1f}")
