"""What dal.auto_quantize hands back: one ``Rung`` per measurement and the ``AutoQuantResult``
table (text with progress bars; ``to_html`` for the HTML report)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn

BAR = 24


class AutoQuantizeError(ValueError):
    """auto_quantize could not go on (bad ``eval_fn`` value, unmet ``max_drop`` with
    ``on_miss="raise"``); ``result`` holds what was measured when there is one."""

    def __init__(self, message: str, result: Optional["AutoQuantResult"] = None):
        super().__init__(message)
        self.result = result


@dataclass
class Rung:
    """One measured configuration: ``metric`` (eval_fn), ``drop`` (float - metric), ``seconds``
    taken, ``layers_changed`` ("path:precision"), the calibration ``method`` and PTQ ``steps``."""

    name: str
    metric: float
    drop: float
    seconds: float
    layers_changed: list = field(default_factory=list)
    method: str = "minmax"
    steps: tuple = ()
    met: bool = False

    def row(self) -> dict:
        return {"rung": self.name, "metric": self.metric, "drop": self.drop, "seconds": self.seconds,
                "layers_changed": list(self.layers_changed), "method": self.method, "steps": list(self.steps),
                "met": self.met}


def bar(fraction: float, width: int = BAR) -> str:
    """``fraction`` (clipped to [0, 1]) as a text progress bar of ``width`` cells."""
    fraction = min(max(fraction, 0.0), 1.0)
    full = int(round(fraction * width))
    return "#" * full + "." * (width - full)


@dataclass
class AutoQuantResult:
    """``model`` (PTQ model ready to export, or a QAT-ready one when ``status == "qat"``),
    ``recipe`` (a ``Recipe``: calibration method, ``ptq`` steps and fallback rules included),
    ``rungs``, ``float_metric``, ``max_drop``, ``status`` ("ptq", "fallback", "qat"), ``chosen``."""

    model: nn.Module
    recipe: object
    rungs: list
    float_metric: float
    max_drop: float
    status: str
    chosen: str

    @property
    def recipe_yaml(self) -> str:
        return self.recipe.to_yaml()

    @property
    def metric(self) -> float:
        return next(r.metric for r in self.rungs if r.name == self.chosen)

    def rows(self) -> list[dict]:
        return [r.row() for r in self.rungs]

    def __str__(self) -> str:
        width = max([len(r.name) for r in self.rungs] + [4])
        lines = [f"dal.auto_quantize: float {self.float_metric:.4f}, max drop {self.max_drop:g} -> "
                 f"{self.status} ({self.chosen})",
                 f"  {'rung':<{width}}  {'metric':>9} {'drop':>8} {'time s':>7}  {'1 - drop/span':<{BAR}}  layers changed"]
        # Full bar = no drop; the max_drop threshold sits at half width (or less when a rung
        # dropped more than twice it, so that every bar fits).
        span = max([2.0 * self.max_drop] + [r.drop for r in self.rungs] + [1e-12])
        for r in self.rungs:
            frac = 1.0 - r.drop / span
            mark = "ok" if r.met else "  "
            lines.append(f"  {r.name:<{width}}  {r.metric:>9.4f} {r.drop:>8.4f} {r.seconds:>7.1f}  "
                         f"{bar(frac)}  {mark} {', '.join(r.layers_changed) or '-'}")
        return "\n".join(lines)

    def to_html(self) -> str:
        """The rung table as an HTML fragment (``dal.analysis.report_auto``)."""
        from ..analysis.report_auto import auto_quantize_panel

        return auto_quantize_panel(self.rows(), self.float_metric, self.max_drop, self.status, self.chosen)
