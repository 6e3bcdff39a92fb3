"""What ``auto_replace`` did: each replacement with its module path and output drift, and the
rules that matched nothing or failed."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn


@dataclass(frozen=True)
class Replacement:
    """One module replaced (or, for a report-only rule, noted).

    ``cosine`` / ``max_abs`` compare the module's output before and after on the example
    inputs (all calls concatenated); None without example inputs or for report-only rules.
    """

    rule: str
    path: str
    old_type: str
    new_type: str
    detail: str = ""
    cosine: Optional[float] = None
    max_abs: Optional[float] = None

    @property
    def noted_only(self) -> bool:
        return self.old_type == self.new_type and self.detail.startswith("kept")


@dataclass(frozen=True)
class RuleFailure:
    rule: str
    path: str
    error: str


@dataclass
class ReplaceReport:
    """Result of :func:`dal.replace.auto_replace`.

    Attributes:
        rules: the rule names applied, in order.
        replacements: :class:`Replacement` rows.
        unmatched: ``{rule: reason}`` for rules that matched no module.
        failed: :class:`RuleFailure` rows (a ``match`` or ``build`` raised). When any build
            failed, nothing was swapped (``applied`` is False) and the model is as it was.
        notes: other changes (e.g. a TransformerEncoder's nested-tensor fast path turned off).
        model: the model (a new root object only when the root module itself was replaced).
    """

    rules: list[str] = field(default_factory=list)
    replacements: list[Replacement] = field(default_factory=list)
    unmatched: dict[str, str] = field(default_factory=dict)
    failed: list[RuleFailure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    applied: bool = True
    model: Optional[nn.Module] = None

    def by_rule(self, name: str) -> list[Replacement]:
        return [r for r in self.replacements if r.rule == name]

    def summary(self) -> str:
        """One line per rule: how many modules it replaced, worst drift, or why it did nothing."""
        parts = []
        for name in self.rules:
            rows = self.by_rule(name)
            fails = [f for f in self.failed if f.rule == name]
            if fails:
                parts.append(f"{name}: FAILED at {', '.join(f.path or '<root>' for f in fails)} "
                             f"({fails[0].error})")
            elif name in self.unmatched:
                parts.append(f"{name}: matched nothing ({self.unmatched[name]})")
            else:
                kept = sum(r.noted_only for r in rows)
                text = f"{name}: {len(rows) - kept} replaced" + (f", {kept} noted" if kept else "")
                cos = [r.cosine for r in rows if r.cosine is not None]
                if cos:
                    text += f" (min cosine {min(cos):.6f}, max |diff| {max(r.max_abs for r in rows if r.max_abs is not None):.3g})"
                parts.append(text)
        if not self.applied:
            parts.append("nothing was swapped: a rule failed, the model is unchanged")
        return "; ".join(parts) or "no rules"

    def __str__(self) -> str:
        lines = [f"dal.replace: {self.summary()}"]
        if self.replacements:
            width = max(len(r.path) for r in self.replacements) + 2
            lines.append(f"{'module':<{width}}{'rule':<16}{'from':<26}{'to':<28}{'cosine':>10}{'max|diff|':>11}  detail")
            for r in self.replacements:
                cos = f"{r.cosine:.6f}" if r.cosine is not None else "-"
                mad = f"{r.max_abs:.3g}" if r.max_abs is not None else "-"
                lines.append(f"{r.path or '<root>':<{width}}{r.rule:<16}{r.old_type:<26}{r.new_type:<28}{cos:>10}"
                             f"{mad:>11}  {r.detail}")
        lines += [f"failed: {f.rule} at {f.path or '<root>'}: {f.error}" for f in self.failed]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
