"""``dal.estimate(model_or_onnx, hardware)``: per-layer and total latency from the hardware's cost model.

    >>> est = dal.estimate(qat_model, "a2000", example_inputs=(x,))      # doctest: +SKIP
    >>> print(est)                 # one row per layer, then the total and a breakdown by engine
    >>> est.total_ms, est.by_engine["matrix"]["cycles"]                  # doctest: +SKIP

A prepared model is traced once with ``example_inputs`` (``dal.cost.torch_graph``), its formats
read from its quantizers (``dal.cost.choices``); an exported QDQ ONNX file is read from its
graph (``dal.cost.onnx_graph``). Each layer is timed by the roofline of ``dal.cost.roofline``;
layers run one after the other, so the total is the sum. Layers off the NPU are listed untimed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..hardware import load_hardware
from ..hardware.cost import MissingCostError, require_cost
from ..config.problems import Problem
from .roofline import LayerCost, free_layer, layer_cost, needs


@dataclass
class Estimate:
    """``rows``: one ``LayerCost`` per layer in execution order; totals and ``by_engine`` derived."""

    hardware: str
    source: str
    clock_mhz: float
    rows: list = field(default_factory=list)

    @property
    def total_cycles(self) -> float:
        return sum(r.cycles for r in self.rows)

    @property
    def total_ms(self) -> float:
        return self.total_cycles / (self.clock_mhz * 1000.0)

    @property
    def macs(self) -> int:
        return sum(r.geom.macs for r in self.rows)

    @property
    def bytes(self) -> float:
        return sum(r.bytes for r in self.rows)

    @property
    def weight_bytes(self) -> float:
        return sum(r.weight_bytes for r in self.rows)

    @property
    def by_engine(self) -> dict:
        """engine -> {"layers", "macs", "cycles", "ms", "share"} (share of the total cycles)."""
        out: dict = {}
        total = self.total_cycles or 1.0
        for r in self.rows:
            e = out.setdefault(r.engine, {"layers": 0, "macs": 0, "cycles": 0.0})
            e["layers"] += 1
            e["macs"] += r.geom.macs
            e["cycles"] += r.cycles
        for e in out.values():
            e["ms"] = e["cycles"] / (self.clock_mhz * 1000.0)
            e["share"] = e["cycles"] / total
        return out

    def to_dict(self) -> dict:
        return {"hardware": self.hardware, "source": self.source, "total_cycles": self.total_cycles,
                "total_ms": self.total_ms, "macs": self.macs, "bytes": self.bytes, "by_engine": self.by_engine,
                "layers": [{"name": r.geom.name, "op_class": r.geom.op_class, "engine": r.engine,
                            "format": r.choice.label if r.choice else "float", "macs": r.geom.macs,
                            "bytes": r.bytes, "compute_cycles": r.compute_cycles, "memory_cycles": r.memory_cycles,
                            "cycles": r.cycles, "bound": r.bound, "note": r.note} for r in self.rows]}

    def table(self) -> str:
        """The terminal table: per layer, then the total and the engines' shares."""
        width = max([len(r.geom.name) for r in self.rows] + [5])
        head = (f"{'layer':<{width}}  {'op':<14} {'engine':<7} {'format':<22} {'MACs':>12} {'bytes':>11} "
                f"{'cycles':>11} {'bound':<7}")
        lines = [f"dal.estimate on {self.hardware} ({self.source}): {self.total_ms:.4f} ms, "
                 f"{self.total_cycles:,.0f} cycles at {self.clock_mhz:g} MHz, {self.macs:,} MACs", head,
                 "-" * len(head)]
        for r in self.rows:
            fmt = r.choice.label if r.choice is not None else "float"
            lines.append(f"{r.geom.name:<{width}}  {r.geom.op_class:<14} {r.engine:<7} {fmt[:22]:<22} "
                         f"{r.geom.macs:>12,} {r.bytes:>11,.0f} {r.cycles:>11,.0f} {r.bound:<7}"
                         + (f" {r.note}" if r.note else ""))
        lines.append("-" * len(head))
        for name, e in sorted(self.by_engine.items(), key=lambda kv: -kv[1]["cycles"]):
            lines.append(f"engine {name:<8} {e['layers']:>4} layers {e['macs']:>14,} MACs {e['cycles']:>13,.0f} "
                         f"cycles {e['ms']:>9.4f} ms {100 * e['share']:5.1f}%")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def estimate_layers(geoms, choices: dict, hw, source: str = "model") -> Estimate:
    """Time ``geoms`` (``LayerGeom``) in the formats ``choices`` (name -> ``Choice`` or None:
    off the NPU) on ``hw``. Raises ``MissingCostError`` listing every cost key that is absent."""
    hw = load_hardware(hw)
    cost = require_cost(hw)
    plan, wanted = [], []
    for g in geoms:
        choice = choices.get(g.name)
        op = hw.op(g.op_class)
        if choice is None or op is None:
            plan.append((g, choice, None))
            continue
        plan.append((g, choice, op.engine))
        wanted += needs(g, choice, op.engine)
    missing = cost.missing(wanted)
    if missing:
        where = hw.source or "<dict>"
        raise MissingCostError([Problem(f"missing cost key {m}; add it (schema: hardware_models/README.md)",
                                        ("cost",), where) for m in missing])
    rows = []
    for g, choice, engine in plan:
        if engine is None:
            note = "off the NPU (float)" if hw.op(g.op_class) is not None else f"{g.op_class}: not run by the NPU"
            rows.append(free_layer(g, choice, note))
        else:
            rows.append(layer_cost(g, choice, engine, hw))
    return Estimate(hw.name, source, cost.clock_mhz, rows)


def estimate(model_or_onnx, hardware=None, example_inputs=None) -> Estimate:
    """Estimate the latency of a prepared model or an exported QDQ ONNX file on ``hardware``.

    Args:
        model_or_onnx: a model returned by ``dal.prepare_qat`` (calibrated or not), or the path
            of an ONNX file written by ``dal.export_onnx``.
        hardware: bundled name, YAML path, dict or ``HardwareModel`` with a ``cost:`` section;
            default: the one the model was prepared for (or the ONNX file's dal metadata).
        example_inputs: inputs to trace a torch model with (their batch size is the batch
            timed); for an ONNX file with a symbolic batch dimension, that dimension is 1.

    Returns an ``Estimate``; ``print(est)`` is the table. A hardware model without ``cost:``
    raises ``MissingCostError`` naming the keys to add.
    """
    from pathlib import Path

    if isinstance(model_or_onnx, (str, Path)):
        from .onnx_graph import onnx_layers

        geoms, choices, meta_hw = onnx_layers(model_or_onnx, hardware)
        hw = hardware if hardware is not None else meta_hw
        if hw is None:
            raise ValueError(f"estimate: {model_or_onnx} names no hardware in its metadata; pass hardware=")
        return estimate_layers(geoms, choices, load_hardware(hw), str(model_or_onnx))
    from ..prepare.handle import find_prepared
    from .choices import prepared_choices
    from .torch_graph import trace_layers

    handle = find_prepared(model_or_onnx)
    if handle is None:
        raise ValueError(f"estimate: {type(model_or_onnx).__name__} was not prepared by dal: call "
                         "dal.prepare_qat(model, recipe=..., hardware=...) first, or pass an exported .onnx path")
    if example_inputs is None:
        raise ValueError("estimate: a torch model needs example_inputs=(x,) to trace its shapes")
    if hardware is None and handle.hardware is None:
        raise ValueError("estimate: the model was prepared without hardware; pass hardware=")
    hw = load_hardware(hardware if hardware is not None else handle.hardware)
    require_cost(hw)
    layers = trace_layers(model_or_onnx, example_inputs)
    return estimate_layers([g for g, _ in layers], prepared_choices(layers, model_or_onnx, hw), hw,
                           f"recipe {getattr(handle.recipe, 'name', '?')}")


__all__ = ["Estimate", "LayerCost", "MissingCostError", "estimate", "estimate_layers"]
