"""Matplotlib figures for the HTML report, returned as ``data:image/png;base64,...`` URIs.

matplotlib is imported inside each function (Agg canvas, no pyplot, no display): ``import dal`` and
``import dal.analysis`` never pay for it.
"""
from __future__ import annotations

import base64
import io
import math


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


def data_uri(fig) -> str:
    """The figure as an embedded PNG (the report must be one self-contained file)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def layer_error_bars(rows: list) -> str:
    """Per layer: 1 - cosine (log scale; lower is better) and PSNR in dB."""
    names = [r["layer"] for r in rows]
    fig = _figure((11, max(2.5, 0.28 * len(rows) + 1.0)))
    a, b = fig.subplots(1, 2, sharey=True)
    a.barh(names, [max(1.0 - r["cosine"], 1e-12) for r in rows], color="#c0504d")
    a.set_xscale("log")
    a.set_xlabel("1 - cosine vs float (lower is better)")
    b.barh(names, [r["psnr"] if math.isfinite(r["psnr"]) else 0.0 for r in rows], color="#4f81bd")
    b.set_xlabel("PSNR dB (higher is better)")
    a.invert_yaxis()
    fig.suptitle("Per-layer output error")
    return data_uri(fig)


def histograms(panels: list, title: str, columns: int = 4) -> str:
    """``panels``: (name, values: numpy array, ranges: list of (lo, hi, style)) drawn as a grid of
    histograms (log counts) with the clipping ranges as vertical lines."""
    rows = max(1, math.ceil(len(panels) / columns))
    fig = _figure((3.2 * columns, 2.4 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, values, ranges) in zip(axes.flat, panels):
        ax.hist(values, bins=100, color="#7f7f7f", log=True)
        for lo, hi, style in ranges:
            ax.axvline(lo, color="#c0504d", linestyle=style, linewidth=1)
            ax.axvline(hi, color="#c0504d", linestyle=style, linewidth=1)
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return data_uri(fig)


def sensitivity_bars(rows: list) -> str:
    """Per layer: the metric drop when only it is quantized and the gain when only it is float."""
    names = [r["layer"] for r in rows]
    fig = _figure((11, max(2.5, 0.28 * len(rows) + 1.0)))
    a, b = fig.subplots(1, 2, sharey=True)
    a.barh(names, [r["drop"] for r in rows], color="#c0504d")
    a.set_xlabel("drop when only this layer is quantized")
    b.barh(names, [r["gain"] for r in rows], color="#9bbb59")
    b.set_xlabel("gain when only this layer is float")
    a.invert_yaxis()
    fig.suptitle("Sensitivity ranking")
    return data_uri(fig)
