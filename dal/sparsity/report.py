"""report(model): per-layer density, pattern validity, retained magnitude, skipped layers."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .controller import find_controller
from .layout import sparse_types, op_class, reduction_axis, to_groups

__all__ = ["SparsityReport", "report"]

_COLUMNS = ("name", "kind", "shape", "status", "density", "valid", "retained", "note")


@dataclass(frozen=True)
class SparsityReport:
    """Plain-data report. ``rows``: one dict per Linear/Conv layer with keys

    - ``name``, ``kind`` ("linear" / "conv" / "conv_transpose"), ``shape`` (weight shape),
    - ``status``: "sparse" or "dense",
    - ``density``: fraction of non-zero stored weights (also for dense layers),
    - ``valid``: every group of M along the reduction axis has at most N non-zeros
      (None for dense layers),
    - ``retained``: ``sum|w_masked| / sum|w_dense|`` at the last mask computation (None for
      dense layers),
    - ``note``: why a layer is dense, or the channel-permutation outcome.

    ``pattern`` is the N:M string, ``step`` the schedule step.
    """

    pattern: str
    step: int
    rows: "list[dict]" = field(default_factory=list)

    @property
    def sparse(self) -> "list[dict]":
        return [r for r in self.rows if r["status"] == "sparse"]

    @property
    def skipped(self) -> "dict[str, str]":
        return {r["name"]: r["note"] for r in self.rows if r["status"] == "dense"}

    @property
    def all_valid(self) -> bool:
        return all(r["valid"] for r in self.sparse)

    def __str__(self) -> str:
        def fmt(r, c):
            v = r[c]
            if v is None:
                return "-"
            if c in ("density", "retained"):
                return f"{v:.3f}"
            if c == "shape":
                return "x".join(map(str, v))
            if c == "valid":
                return "yes" if v else "NO"
            return str(v)
        table = [list(_COLUMNS)] + [[fmt(r, c) for c in _COLUMNS] for r in self.rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS) - 1)]
        lines = [f"N:M sparsity {self.pattern}, step {self.step}: {len(self.sparse)} sparse, "
                 f"{len(self.rows) - len(self.sparse)} dense layers"]
        for row in table:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        return "\n".join(lines)


def report(model: nn.Module) -> SparsityReport:
    """Report on every Linear / Conv / ConvTranspose of ``model``. Works from the
    ``weight_mask`` buffers (so also on a model restored from a state_dict); reasons for
    dense layers come from the controller that ``prepare_sparse`` attached."""
    ctl = find_controller(model)
    n, m = (ctl.pattern.n, ctl.pattern.m) if ctl is not None else (2, 4)
    skipped = ctl.skipped if ctl is not None else {}
    notes = ctl.permuted if ctl is not None else {}
    rows, step = [], 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, sparse_types()):
                continue
            w = mod.weight
            if isinstance(w, nn.parameter.UninitializedParameter):
                rows.append(dict(name=name, kind=op_class(mod), shape=(), status="dense",
                                 density=None, valid=None, retained=None,
                                 note=skipped.get(name, "lazy module, not initialized")))
                continue
            row = dict(name=name, kind=op_class(mod), shape=tuple(w.shape),
                       density=float((w != 0).sum()) / max(1, w.numel()))
            mask = getattr(mod, "weight_mask", None)
            if mask is None:
                row.update(status="dense", valid=None, retained=None,
                           note=skipped.get(name, "not prepared for sparsity"))
            else:
                stats = mod.weight_sparsity_stats
                step = int(stats[0])
                nz = (to_groups(w, reduction_axis(mod), m) != 0).sum(dim=1)
                row.update(status="sparse", valid=bool((nz <= n).all()),
                           retained=float(stats[2] / stats[1]) if stats[1] > 0 else 1.0,
                           note=notes.get(name, ""))
            rows.append(row)
    pattern = f"{n}:{m}"
    return SparsityReport(pattern=pattern, step=ctl.current_step if ctl else step, rows=rows)
