"""The ``cost:`` section of a hardware model: how long the chip takes, for ``dal.cost.estimate``.

    cost:
      clock_mhz: 1000                 # engine clock
      dram_gb_per_s: 64               # memory bandwidth (10^9 bytes per second)
      layer_overhead_cycles: 400      # fixed cost of launching one layer
      engines:
        matrix:
          macs_per_cycle: {int8: 4096, int4: 8192, fp16: 1024}   # dense, by weight format
          sparse_macs_per_cycle: {int8: 8192, int4: 16384}       # 2:4 sparse weights
        vector:
          elements_per_cycle: {int8: 64, fp16: 32}               # element-wise ops
          lut_elements_per_cycle: 32                             # table lookups

Every key is validated when the hardware model loads (``file:line: cost.engines.x: ...``);
whether the section holds every entry a given model needs is checked when the estimate runs
(``CostModel.missing``), so one error lists every missing key at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dal.config.fields import Checker
from dal.config.problems import Problem
from dal.formats.qformat import QFormat
from dal.hardware.errors import HardwareModelError

COST_KEYS = ("clock_mhz", "dram_gb_per_s", "layer_overhead_cycles", "engines")
ENGINE_COST_KEYS = ("macs_per_cycle", "sparse_macs_per_cycle", "elements_per_cycle", "lut_elements_per_cycle")
#: what ``cost:`` needs at the least, shown by the error of a hardware model without it
REQUIRED = "clock_mhz, dram_gb_per_s, layer_overhead_cycles, engines.<engine>.macs_per_cycle / elements_per_cycle"


class MissingCostError(HardwareModelError):
    """The hardware model lacks the cost keys an estimate needs (each missing key named)."""

    what = "hardware cost model"


@dataclass(frozen=True)
class EngineCost:
    """Throughput of one engine: per format name, MACs (dense / 2:4 sparse) or elements per cycle."""

    name: str
    macs_per_cycle: tuple[tuple[str, float], ...] = ()
    sparse_macs_per_cycle: tuple[tuple[str, float], ...] = ()
    elements_per_cycle: tuple[tuple[str, float], ...] = ()
    lut_elements_per_cycle: float | None = None

    def rate(self, table: str, fmt: "QFormat | str") -> float | None:
        """``table`` (``macs_per_cycle``...) entry for ``fmt``, None when the YAML does not give it."""
        name = getattr(fmt, "name", fmt)
        return dict(getattr(self, table)).get(name)

    def to_dict(self) -> dict:
        out: dict = {}
        for key in ENGINE_COST_KEYS[:3]:
            if getattr(self, key):
                out[key] = dict(getattr(self, key))
        if self.lut_elements_per_cycle is not None:
            out["lut_elements_per_cycle"] = self.lut_elements_per_cycle
        return out


@dataclass(frozen=True)
class CostModel:
    """Clock, bandwidth, per-layer overhead and per-engine throughput (see the module docstring).

    ``bytes_per_cycle = dram_gb_per_s * 1000 / clock_mhz``; one cycle lasts ``1 / clock_mhz`` us.
    """

    clock_mhz: float
    dram_gb_per_s: float
    layer_overhead_cycles: float
    engines: tuple[EngineCost, ...] = ()
    source: str | None = field(default=None, compare=False, repr=False)

    @property
    def bytes_per_cycle(self) -> float:
        return self.dram_gb_per_s * 1000.0 / self.clock_mhz

    def cycles_to_ms(self, cycles: float) -> float:
        return cycles / (self.clock_mhz * 1000.0)

    def engine(self, name: str) -> EngineCost | None:
        return next((e for e in self.engines if e.name == name), None)

    def missing(self, needs) -> list[str]:
        """The keys absent for ``needs``: (engine, table, format name or None, who needs it);
        one line per key, naming the first layers that need it."""
        by_key: dict = {}
        for engine, table, fmt, who in needs:
            e = self.engine(engine)
            if table == "lut_elements_per_cycle":
                ok = e is not None and e.lut_elements_per_cycle is not None
                key = f"cost.engines.{engine}.lut_elements_per_cycle"
            else:
                ok = e is not None and e.rate(table, fmt) is not None
                key = f"cost.engines.{engine}.{table}.{fmt}"
            if not ok and who not in by_key.setdefault(key, []):
                by_key[key].append(who)
        return [f"{k} (needed by {', '.join(w[:4])}{f' and {len(w) - 4} more' if len(w) > 4 else ''})"
                for k, w in sorted(by_key.items())]

    def to_dict(self) -> dict:
        return {"clock_mhz": self.clock_mhz, "dram_gb_per_s": self.dram_gb_per_s,
                "layer_overhead_cycles": self.layer_overhead_cycles,
                "engines": {e.name: e.to_dict() for e in self.engines}}


def require_cost(hw) -> CostModel:
    """``hw.cost``, or ``MissingCostError`` naming the missing section and its required keys."""
    cost = getattr(hw, "cost", None)
    if cost is None:
        where = getattr(hw, "source", None) or "<dict>"
        raise MissingCostError(Problem(
            f"hardware model {hw.name!r} has no 'cost' section, so no latency can be estimated; add "
            f"cost: with the keys {REQUIRED} (schema: hardware_models/README.md)", ("cost",), where))
    return cost


def _number(c: Checker, value, path: tuple, positive: bool = True) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        c.add(path, f"expected a number, got {value!r}")
        return None
    if value < 0 or (positive and value == 0):
        c.add(path, f"{value!r} is out of range; expected a number {'> 0' if positive else '>= 0'}")
        return None
    return float(value)


def _table(c: Checker, raw, path: tuple, formats) -> tuple | None:
    """A mapping of format name -> positive number; each format must be one of the engine's."""
    if not isinstance(raw, dict):
        c.add(path, f"expected a mapping of format name -> number, got {raw!r}")
        return None
    out = []
    for name, value in raw.items():
        fmt = c.qformat(name, path + (name,))
        rate = _number(c, value, path + (name,))
        if fmt is None or rate is None:
            continue
        if formats is not None and fmt.name not in formats:
            c.add(path + (name,), f"{fmt.name} is not a format of this engine (its formats: "
                                  f"{', '.join(sorted(formats)) or '(none)'})")
            continue
        out.append((fmt.name, rate))
    return tuple(sorted(out))


def _engine_formats(c: Checker, engines_raw, name) -> set | None:
    body = engines_raw.get(name) if isinstance(engines_raw, dict) else None
    if not isinstance(body, dict) or "formats" not in body:
        return None
    fmts = Checker().qformats(body["formats"], ())
    return {f.name for f in fmts} if fmts else None


def parse_cost(c: Checker, raw, engines_raw=None) -> CostModel | None:
    """The ``cost:`` mapping of a hardware YAML; problems go to ``c`` (located at file:line later).

    ``engines_raw`` is the document's ``engines:`` mapping: cost engines must be among them and
    their formats among each engine's formats. ``cost: null`` means no cost model.
    """
    if raw is None:
        return None
    data = c.mapping(raw, ("cost",), COST_KEYS, required=COST_KEYS)
    if data is None:
        return None
    kw = {}
    for key in COST_KEYS[:3]:
        if key in data:
            kw[key] = _number(c, data[key], ("cost", key), positive=key != "layer_overhead_cycles")
    engines = []
    body = data.get("engines")
    if "engines" in data and not isinstance(body, dict):
        c.add(("cost", "engines"), f"expected a mapping of engine name -> {{{', '.join(ENGINE_COST_KEYS)}}}, "
                                   f"got {body!r}")
    for name, eng in (body.items() if isinstance(body, dict) else ()):
        path = ("cost", "engines", name)
        if isinstance(engines_raw, dict) and name not in engines_raw:
            c.add(path, f"engine {name!r} is not one of the hardware's engines ({', '.join(map(str, engines_raw))})")
            continue
        if c.mapping(eng, path, ENGINE_COST_KEYS) is None:
            continue
        formats = _engine_formats(c, engines_raw, name)
        ekw = {k: _table(c, eng[k], path + (k,), formats) for k in ENGINE_COST_KEYS[:3] if k in eng}
        if "lut_elements_per_cycle" in eng:
            ekw["lut_elements_per_cycle"] = _number(c, eng["lut_elements_per_cycle"], path + ("lut_elements_per_cycle",))
        if not any(k in eng for k in ("macs_per_cycle", "elements_per_cycle")):
            c.add(path, "give macs_per_cycle (a matrix engine) or elements_per_cycle (vector / dsp), or both")
        for fmt, rate in dict(ekw.get("sparse_macs_per_cycle") or ()).items():
            dense = dict(ekw.get("macs_per_cycle") or ()).get(fmt)
            if dense is not None and rate < dense:
                c.add(path + ("sparse_macs_per_cycle", fmt), f"{rate:g} is below the dense rate {dense:g}: "
                      "skipping zeros cannot be slower than computing them")
        if None not in ekw.values():
            engines.append(EngineCost(str(name), **ekw))
    if None in kw.values() or len(kw) < 3:
        return None
    return CostModel(engines=tuple(engines), **kw)
