"""The prepare report: every module, quantized (with formats) or left in float (with why)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerRow:
    name: str
    type_name: str
    op_class: str
    status: str          # "quantized", "fp16", "float", "container"
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

    def __str__(self) -> str:
        head = f"dal.prepare_qat: recipe={self.recipe} hardware={self.hardware}: " \
               f"{len(self.by_status('quantized'))} quantized, {len(self.by_status('fp16'))} fp16, " \
               f"{len(self.by_status('float'))} left in float"
        width = max([len(r.name) for r in self.rows] + [6])
        lines = [head, f"{'module':<{width}}  {'type':<22} {'status':<9} detail"]
        for r in self.rows:
            if r.status != "container":
                lines.append(f"{r.name:<{width}}  {r.type_name:<22} {r.status:<9} {r.detail}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
