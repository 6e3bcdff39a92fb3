"""The cost of one layer on the chip: a roofline of compute against memory traffic.

For a layer with ``macs`` multiply-accumulates on engine ``e`` (``hw.op(op_class).engine``):

    aligned_macs = macs * pad(C_in) / C_in * pad(C_out) / C_out     pad(c) = ceil(c / a) * a,
                                                                     a = hw.channel_alignment
    rate         = macs_per_cycle[w]            (2:4 sparse weights: sparse_macs_per_cycle[w])
                   capped at macs_per_cycle[x] when the input format x is wider than 8 bits
    compute      = aligned_macs / rate
    bytes        = weight_elems * bits(w) / 8    (2:4: half the values plus a 2-bit index each)
                 + input_elems * bits(x) / 8 + output_elems * bits(y) / 8
    memory       = bytes / (dram_gb_per_s * 1000 / clock_mhz)
    cycles       = max(compute, memory) + layer_overhead_cycles

``w`` is the weight format (for matmul, which has no weight, the input format), ``x`` the
input format and ``y`` the output format. The matrix engine's 8-bit activation path feeds every
weight mode (int4 weights pack two per lane), so 8-bit inputs run at the weight format's rate;
wider inputs (int16, fp16) run at their own. Element-wise layers (vector / dsp engines) take
``elements / elements_per_cycle[x]`` (``lut_elements_per_cycle`` for lookup-table activations)
for compute. Every rate comes from the hardware YAML's ``cost:`` section.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..formats import get_format
from ..formats.qformat import QFormat
from .op_costs import matrix_classes


@dataclass(frozen=True)
class LayerGeom:
    """What a layer computes, independent of formats: ``macs`` (true count), element counts
    of its weight / inputs / output, and the channel counts the alignment pads."""

    name: str
    op_class: str
    macs: int = 0
    weight_elems: int = 0
    input_elems: int = 0
    output_elems: int = 0
    in_channels: int = 1
    out_channels: int = 1
    function: str = ""        # activation function name (for lookup tables), or ""
    type_name: str = ""

    @property
    def is_matrix(self) -> bool:
        """On the matrix engine: an op class of the ops whose ``cost`` is ``"matrix"`` (dal.ops)."""
        return self.op_class in matrix_classes()


@dataclass(frozen=True)
class Choice:
    """Formats a layer runs in: ``weight`` (None: no weight), ``input``, ``output`` and 2:4
    ``sparse``; ``lut`` for an activation evaluated through the lookup table."""

    weight: Optional[QFormat] = None
    input: Optional[QFormat] = None
    output: Optional[QFormat] = None
    sparse: bool = False
    lut: bool = False

    def __post_init__(self):
        for key in ("weight", "input", "output"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, QFormat):
                object.__setattr__(self, key, get_format(v))
        if self.output is None and self.input is not None:
            object.__setattr__(self, "output", self.input)

    @property
    def label(self) -> str:
        w = f"w{self.weight.name}" if self.weight is not None else ""
        a = f"a{self.input.name}" if self.input is not None else ""
        return "/".join(p for p in (w, a) if p) + (" 2:4" if self.sparse else "") + (" lut" if self.lut else "")


@dataclass(frozen=True)
class LayerCost:
    """One row of an estimate: geometry, formats, engine and the roofline's numbers."""

    geom: LayerGeom
    choice: Optional[Choice]
    engine: str
    compute_cycles: float
    memory_cycles: float
    bytes: float
    cycles: float
    weight_bytes: float = 0.0
    note: str = ""

    @property
    def bound(self) -> str:
        if self.cycles == 0:
            return "-"
        return "compute" if self.compute_cycles >= self.memory_cycles else "memory"


def _pad(c: int, a: int) -> int:
    return max(1, math.ceil(max(c, 1) / a) * a)


def weight_bytes(geom: LayerGeom, choice: Choice) -> float:
    """Bytes of the stored weight: ``elems * bits / 8``; 2:4 keeps half the values plus a 2-bit index each."""
    if choice.weight is None or not geom.weight_elems:
        return 0.0
    bits = choice.weight.bits
    if choice.sparse:
        return geom.weight_elems / 2 * (bits + 2) / 8
    return geom.weight_elems * bits / 8


def needs(geom: LayerGeom, choice: Choice, engine: str) -> list[tuple]:
    """The cost-table entries this layer reads: (engine, table, format name, who)."""
    who = geom.name
    if geom.is_matrix:
        w = choice.weight or choice.input
        table = "sparse_macs_per_cycle" if choice.sparse else "macs_per_cycle"
        out = [(engine, table, w.name, who)]
        if choice.input is not None and choice.input.bits > 8:
            out.append((engine, "macs_per_cycle", choice.input.name, who))
        return out
    if choice.lut:
        return [(engine, "lut_elements_per_cycle", None, who)]
    return [(engine, "elements_per_cycle", choice.input.name, who)]


def layer_cost(geom: LayerGeom, choice: Choice, engine: str, hw) -> LayerCost:
    """The roofline of the module docstring for one layer (every needed rate must exist:
    call ``CostModel.missing(needs(...))`` first to report absent keys at once)."""
    cost = hw.cost
    eng = cost.engine(engine)
    xbits = choice.input.bits if choice.input is not None else 0
    ybits = choice.output.bits if choice.output is not None else xbits
    act_bytes = (geom.input_elems * xbits + geom.output_elems * ybits) / 8
    wb = weight_bytes(geom, choice)
    total = act_bytes + wb
    if geom.is_matrix:
        w = choice.weight or choice.input
        rate = eng.rate("sparse_macs_per_cycle" if choice.sparse else "macs_per_cycle", w)
        if choice.input is not None and choice.input.bits > 8:
            rate = min(rate, eng.rate("macs_per_cycle", choice.input))
        a = hw.channel_alignment
        aligned = geom.macs * _pad(geom.in_channels, a) / max(geom.in_channels, 1) \
            * _pad(geom.out_channels, a) / max(geom.out_channels, 1)
        compute = aligned / rate
    else:
        rate = eng.lut_elements_per_cycle if choice.lut else eng.rate("elements_per_cycle", choice.input)
        compute = max(geom.input_elems, geom.output_elems) / rate
    memory = total / cost.bytes_per_cycle
    cycles = max(compute, memory) + cost.layer_overhead_cycles
    return LayerCost(geom, choice, engine, compute, memory, total, cycles, wb)


def free_layer(geom: LayerGeom, choice: Optional[Choice], note: str) -> LayerCost:
    """A layer the estimate lists but does not time (fused into its producer, or off the NPU)."""
    return LayerCost(geom, choice, "-", 0.0, 0.0, 0.0, 0.0, 0.0, note)
