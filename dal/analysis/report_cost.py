"""The report's latency section: a ``dal.estimate`` result as a plot and tables, and, when given,
the Pareto front of a ``dal.search_precision`` result.

The plot is one horizontal bar per layer (estimated cycles, coloured by engine; a hatched bar
is memory-bound), first layer on top, so the layers that cost the time stand out. The numbers
are the hardware YAML's cost model: the section says they are estimates, not measurements.
"""
from __future__ import annotations

from . import report_html as H

ENGINE_COLORS = {"matrix": "#3b6ea8", "vector": "#d9822b", "dsp": "#6a9f3b", "-": "#aaaaaa"}


def latency_plot(est) -> str:
    """PNG data URI: cycles per layer, coloured by engine, hatched when memory-bound."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .plots import data_uri

    rows = est.rows
    names = [r.geom.name for r in rows]
    width = max([len(n) for n in names] + [8])
    fig = Figure(figsize=(7.0, 0.6 + 0.2 * len(rows)))  # no pyplot: no global backend or figure registry
    FigureCanvasAgg(fig)
    ax = fig.add_axes([min(0.45, 0.012 * width + 0.05), 0.35 / (0.6 + 0.2 * len(rows)) + 0.02, 0.5, 0.9])
    y = list(range(len(rows)))[::-1]
    for yi, r in zip(y, rows):
        ax.barh(yi, r.cycles, color=ENGINE_COLORS.get(r.engine, "#777777"),
                hatch="///" if r.bound == "memory" else None, edgecolor="white")
    ax.set_yticks(y)
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel(f"estimated cycles at {est.clock_mhz:g} MHz (hatched: memory-bound)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    from matplotlib.patches import Patch

    used = sorted({r.engine for r in rows})
    ax.legend(handles=[Patch(color=ENGINE_COLORS.get(e, "#777777"), label=e) for e in used], fontsize=7,
              loc="lower right")
    return data_uri(fig, tight=False)


def latency_section(est, search=None) -> str:
    """``<h2 id="latency">``: total, per-engine table, the plot, and the search's Pareto front."""
    engines = sorted(est.by_engine.items(), key=lambda kv: -kv[1]["cycles"])
    parts = ['<h2 id="latency">Estimated latency</h2>',
             H.verdict_box("none", [f"{est.total_ms:.4f} ms on {est.hardware} ({est.total_cycles:,.0f} cycles, "
                                    f"{est.macs:,} MACs, {est.bytes:,.0f} bytes moved): an estimate from the "
                                    "hardware model's cost: section (a roofline per layer), not a measurement."]),
             H.table(engines, [("engine", lambda kv: kv[0]), ("layers", lambda kv: kv[1]["layers"]),
                               ("MACs", lambda kv: f"{kv[1]['macs']:,}"), ("cycles", lambda kv: f"{kv[1]['cycles']:,.0f}"),
                               ("ms", lambda kv: kv[1]["ms"]), ("share", lambda kv: f"{100 * kv[1]['share']:.1f}%")],
                     name="latency-engines"),
             H.img(latency_plot(est), "estimated cycles per layer")]
    if search is not None:
        pts = sorted(search.front, key=lambda p: p[0])
        measured = {search.front[i][0]: v for i, v in getattr(search, "measured", {}).items()}
        parts.append(f"<h3>Pareto front of dal.search_precision ({H.esc(search.method)})</h3>")
        parts.append(H.table(pts, [("latency (ms)", lambda p: p[0]), ("x INT8", lambda p: p[0] / search.int8_latency_ms),
                                   ("weight bytes", lambda p: f"{p[1]:,.0f}"), ("predicted score", lambda p: p[2]),
                                   ("measured", lambda p: measured.get(p[0], "-")),
                                   ("<formats", lambda p: ", ".join(f"{n}={k}" for n, k in p[3].items()))],
                             name="pareto"))
    return "".join(parts)
