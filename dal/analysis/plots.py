"""Matplotlib figures for the HTML report, returned as ``data:image/png;base64,...`` URIs.

matplotlib is imported inside each function (Agg canvas, no pyplot, no display): ``import dal`` and
``import dal.analysis`` never pay for it.

No figure has a ``suptitle``: the report's own heading names it. A suptitle sits at a fixed
fraction of the figure's height above the axes, so on a tall bar chart (one bar per layer) it left
a blank band of inches between title and bars. Margins are fixed, computed from the label
lengths, rather than ``bbox_inches="tight"``: a tight crop draws each figure twice.
"""
from __future__ import annotations

import base64
import io
import math

import numpy as np


def require_matplotlib(feature: str = "dal.report") -> None:
    """Raise ImportError naming ``pip install 'dal[report]'`` unless matplotlib can be imported.

    Called first by the report (and ``dal report``), so a missing extra fails in a second, not
    after minutes of analysis.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{feature} draws its figures with matplotlib, which is not installed: "
                          "pip install 'dal[report]'") from err


def _figure(figsize):
    # A bare Figure rendered by the Agg canvas: no pyplot, so no global backend switch and no
    # figure registry (the user's own interactive session is left alone).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def data_uri(fig, dpi: int = 80, tight: bool = True) -> str:
    """The figure as an embedded PNG (the report must be one self-contained file)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None, pad_inches=0.05)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _own_value_formatter():
    """Tick labels that each say their own value ("2e-13", "0.0004"): matplotlib's shared offset
    text ("1e-6" past the axis end) falls outside a figure with tight margins."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:.3g}".replace("e-0", "e-").replace("e+0", "e"))


def _bar_pair(names: list, left: list, right: list, labels: tuple, colors: tuple, log_left: bool = False) -> str:
    """Two horizontal bar charts sharing the layer axis, one bar per layer, first layer on top."""
    width, height = 10.0, 0.17 * len(names) + 0.58
    label = 0.2 + 0.058 * max([len(n) for n in names] + [4])  # inches of 7 pt layer names
    fig = _figure((width, height))
    a, b = fig.subplots(1, 2, sharey=True)
    fig.subplots_adjust(left=min(label / width, 0.5), right=0.985, wspace=0.04, top=1 - 0.28 / height,
                        bottom=0.3 / height)
    a.barh(names, left, color=colors[0])
    b.barh(names, right, color=colors[1])
    if log_left:
        a.set_xscale("log")
    for ax in (b,) if log_left else (a, b):
        ax.xaxis.set_major_formatter(_own_value_formatter())
    for ax, label in ((a, labels[0]), (b, labels[1])):
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    a.set_ylim(len(names) - 0.5, -0.5)  # first layer on top, no empty slot above or below
    return data_uri(fig, dpi=90, tight=False)


def layer_error_bars(rows: list) -> str:
    """Per layer, in execution order: 1 - cosine (log scale; lower is better) and PSNR in dB."""
    return _bar_pair([r["layer"] for r in rows], [max(1.0 - r["cosine"], 1e-12) for r in rows],
                     [r["psnr"] if math.isfinite(r["psnr"]) else 0.0 for r in rows],
                     ("1 - cosine vs float (lower is better)", "PSNR dB (higher is better)"),
                     ("#c0504d", "#4f81bd"), log_left=True)


def sensitivity_bars(rows: list) -> str:
    """Per layer: the metric drop when only it is quantized and the gain when only it is float."""
    return _bar_pair([r["layer"] for r in rows], [r["drop"] for r in rows], [r["gain"] for r in rows],
                     ("drop when only this layer is quantized", "gain when only this layer is float"),
                     ("#c0504d", "#9bbb59"))


class HistogramPlotter:
    """Draws one small histogram per call on one reused figure: ``plot(counts, edges, ranges,
    title)`` -> PNG data URI. The artists are made once and only their data change between
    calls: a new Figure, or ``Axes.cla()``, per panel rebuilds every tick and costs ~5x the
    drawing itself (hundreds of panels per report).

    ``counts`` / ``edges``: a precomputed histogram (``len(edges) == len(counts) + 1``), drawn
    with log counts; ``ranges``: up to two (lo, hi, linestyle) clipping ranges drawn as red
    vertical lines.
    """

    def __init__(self, size=(3.3, 1.75), dpi: int = 80):
        from matplotlib.ticker import LogLocator, MaxNLocator, NullLocator

        self.fig = _figure(size)
        self.dpi = dpi
        ax = self.ax = self.fig.add_axes((0.12, 0.15, 0.85, 0.71))
        ax.set_yscale("log")
        self.bars = ax.stairs([1.0], [0.0, 1.0], baseline=0.5, fill=True, color="#7f7f7f")
        self.lines = [ax.axvline(0.0, color="#c0504d", linewidth=1) for _ in range(4)]
        self.title = self.fig.text(0.5, 0.97, "", ha="center", va="top", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.xaxis.set_major_formatter(_own_value_formatter())
        ax.yaxis.set_major_locator(LogLocator(numticks=4))
        ax.yaxis.set_minor_locator(NullLocator())  # minor log ticks: many labels, little information
        ax.tick_params(labelsize=7, pad=1)

    def plot(self, counts, edges, ranges, title: str) -> str:
        counts = np.asarray(counts, dtype=np.float64)
        # Empty bins sit at the baseline (0.5, below the smallest count) instead of log(0).
        self.bars.set_data(np.where(counts > 0, counts, 0.5), np.asarray(edges, dtype=np.float64), baseline=0.5)
        xs = [float(edges[0]), float(edges[-1])]
        ends = [(v, style) for lo, hi, style in ranges[:2] for v in (lo, hi)]
        for line, end in zip(self.lines, ends + [None] * (len(self.lines) - len(ends))):
            line.set_visible(end is not None)
            if end is not None:
                line.set_xdata([end[0], end[0]])
                line.set_linestyle(end[1])
                xs.append(end[0])
        lo, hi = min(xs), max(xs)
        pad = 0.03 * (hi - lo) if hi > lo else max(abs(lo), 1.0) * 0.05
        self.ax.set_xlim(lo - pad, hi + pad)
        self.ax.set_ylim(0.5, max(float(counts.max(initial=1.0)), 1.0) * 2.0)
        self.title.set_text(title)
        return data_uri(self.fig, self.dpi, tight=False)
