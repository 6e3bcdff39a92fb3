"""The prepare report: every module and functional op prepare saw, rendered from its plan:
quantized (with formats), fp16, passthrough (exact on codes), left in float (with why), or on the
host (an op the hardware has no engine for: dal.hardware.op_classes.HOST_OP_CLASSES)."""
from __future__ import annotations

from dataclasses import dataclass, field

STATUSES = ("quantized", "fp16", "passthrough", "float", "host")


@dataclass(frozen=True)
class LayerRow:
    name: str
    type_name: str
    op_class: str
    status: str          # one of STATUSES
    detail: str = ""     # formats, or the reason it stayed float


@dataclass
class PrepareReport:
    """What ``prepare_qat`` did. ``rows`` is plain data; ``str(report)`` is a table."""

    recipe: str = ""
    hardware: str = ""
    rows: list[LayerRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    replacements: object = None  # dal.replace's report when the recipe asked for replacements

    def add(self, *args, **kwargs) -> None:
        self.rows.append(LayerRow(*args, **kwargs))

    def by_status(self, status: str) -> list[LayerRow]:
        return [r for r in self.rows if r.status == status]

    @property
    def quantized(self) -> list[LayerRow]:
        return self.by_status("quantized") + self.by_status("fp16")

    def summary(self) -> str:
        """``N quantized, N fp16, N passthrough, N left in float`` (``, N on the host`` when there are
        ops the hardware has no engine for)."""
        counts = {s: len(self.by_status(s)) for s in STATUSES}
        return (f"{counts['quantized']} quantized, {counts['fp16']} fp16, {counts['passthrough']} passthrough, "
                f"{counts['float']} left in float" + (f", {counts['host']} on the host" if counts["host"] else ""))

    def __str__(self) -> str:
        head = f"dal.prepare_qat: recipe={self.recipe} hardware={self.hardware}: {self.summary()}"
        width = max([len(r.name) for r in self.rows] + [6])
        lines = [head, f"{'module':<{width}}  {'type':<22} {'status':<11} detail"]
        lines += [f"{r.name:<{width}}  {r.type_name:<22} {r.status:<11} {r.detail}" for r in self.rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def describe(spec) -> str:
    """``i=uint8/per_tensor w=int8/per_channel [sparse=2:4]`` for a LayerSpec, ``fp16`` for a fallback."""
    if spec is None:
        return ""
    if spec.fallback_fp16:
        return "fp16"
    parts = [f"{role[0]}={t.format.name}/{t.granularity}" for role in ("input", "weight", "output")
             if (t := getattr(spec, role)) is not None]
    if spec.sparsity:
        parts.append(f"sparse={spec.sparsity}")
    return " ".join(parts)


def rows_from_plan(plan) -> list[LayerRow]:
    """One row per plan step, in the plan's (module) order."""
    rows = []
    for s in plan:
        if s.action == "ready-made":
            status = "fp16" if s.reason.replace("ready-made:", "").split() and all(
                p.endswith("=fp16") for p in s.reason.replace("ready-made:", "").split()) else "quantized"
            detail = s.reason
        elif s.action in ("quantize", "fuse", "functional"):
            status = "fp16" if s.fp16 else "quantized"
            detail = "; ".join(x for x in (s.reason, describe(s.spec)) if x)
        else:
            status, detail = s.action, s.reason  # passthrough, fp16 (a normalisation), float, host
        rows.append(LayerRow(s.path, s.shown_type, s.op_class, status, detail))
    return rows
