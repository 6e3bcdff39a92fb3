"""The report's auto_quantize panel: one row per rung (metric, drop, time, layers changed) with a
bar of the metric relative to float and the ``max_drop`` threshold marked on it.

It takes plain rows (``AutoQuantResult.rows()``), so the analysis layer needs nothing from dal.ptq.
"""
from __future__ import annotations

from . import report_html as H


def _bar(metric: float, float_metric: float, max_drop: float) -> str:
    """A CSS bar: width = metric / float; a tick at (float - max_drop) / float."""
    def pct(v):
        return max(0.0, min(100.0, 100.0 * v / float_metric)) if float_metric else 0.0
    return (f'<div style="position:relative;width:14em;height:0.9em;background:#eee">'
            f'<div style="width:{pct(metric):.1f}%;height:100%;background:#4a7"></div>'
            f'<div style="position:absolute;top:0;left:{pct(float_metric - max_drop):.1f}%;width:2px;'
            f'height:100%;background:#c33"></div></div>')


def auto_quantize_panel(rows: list, float_metric: float, max_drop: float, status: str, chosen: str) -> str:
    """HTML section ``id="auto-quantize"``: the verdict and the rung table (rows as dicts with
    rung, metric, drop, seconds, layers_changed, method, steps, met)."""
    kind = "pass" if status in ("ptq", "fallback") else "warn"
    verdict = H.verdict_box(kind, [f"Float metric {H.num(float_metric)}; allowed drop {H.num(max_drop)}.",
                                   f"Settled on: {chosen} ({status})." + (
                                       " No PTQ rung met the drop: the model is prepared for QAT."
                                       if status == "qat" else "")])
    columns = [("rung", lambda r: r["rung"]),
               ("metric", lambda r: r["metric"]),
               ("drop", lambda r: r["drop"]),
               ("vs float", lambda r: ("html", _bar(r["metric"], float_metric, max_drop))),
               ("met", lambda r: "yes" if r["met"] else "no"),
               ("time (s)", lambda r: f"{r['seconds']:.1f}"),
               ("<calibration / steps", lambda r: " + ".join([r["method"]] + list(r["steps"]))),
               ("<layers changed", lambda r: ", ".join(r["layers_changed"]) or "-")]
    return ('<h2 id="auto-quantize">auto_quantize: the PTQ ladder</h2>' + verdict
            + H.table(rows, columns, name="auto-quantize"))
