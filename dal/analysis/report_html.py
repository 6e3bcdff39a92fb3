"""HTML pieces of the report: page, tables, verdict box, the per-layer histogram rows. No analysis here."""
from __future__ import annotations

import html
import math
import re
from typing import Callable, Optional, Sequence

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;color:#222;margin:0 auto;max-width:1240px;
  padding:1em 1.5em 3em;line-height:1.35}
h1{font-size:1.45em;margin:.3em 0 .2em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;
  margin:1.6em 0 .5em}h3{font-size:1em;margin:1em 0 .3em}
p{margin:.4em 0}.meta{color:#555;font-size:13px;margin:0 0 .6em}.note{color:#555;font-size:12px}
table{border-collapse:collapse;font-size:12px;margin:.3em 0 .8em}
td,th{border:1px solid #d0d0d0;padding:3px 8px;text-align:right;vertical-align:top}
th{background:#f2f2f2;font-weight:600;white-space:nowrap}td.l,th.l{text-align:left}td:not(.l){white-space:nowrap}
td.pass{color:#1e7e34;font-weight:600}td.fail{color:#c5221f;font-weight:600}td.warn{color:#b06000;font-weight:600}
td.info{color:#666}
.verdict{border-radius:6px;padding:.6em 1em;margin:.6em 0;font-size:14px}
.verdict p{margin:.25em 0}.verdict.pass{background:#e6f4ea;border:1px solid #34a853}
.verdict.fail{background:#fce8e6;border:1px solid #d93025}.verdict.warn{background:#fef7e0;border:1px solid #f9ab00}
.verdict.none{background:#f4f4f4;border:1px solid #bbb}
.cols{display:flex;flex-wrap:wrap;gap:0 2em;align-items:flex-start}
img{max-width:100%;height:auto;display:block;margin:0}
.hrow{display:flex;flex-wrap:wrap;gap:4px 6px;align-items:flex-start;border-top:1px solid #e4e4e4;padding:6px 0}
.hrow .info{width:250px;font-size:12px;overflow-wrap:anywhere}.hrow .info b{font-size:13px}
.hrow .empty{width:262px;height:138px;color:#999;font-size:12px;display:flex;align-items:center;
  justify-content:center;border:1px dashed #ddd}
.hhead{display:flex;gap:6px;font-size:12px;font-weight:600;color:#444;position:sticky;top:0;background:#fff;
  padding:3px 0}.hhead span{width:264px}.hhead span:first-child{width:250px}
details{margin:.5em 0}summary{cursor:pointer;color:#1a57b0}
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:11.5px;line-height:1.3}
a{color:#1a57b0;text-decoration:none}a:hover{text-decoration:underline}
nav{font-size:13px;margin:.4em 0}nav a{margin-right:1em}
"""

esc = html.escape


def anchor(layer: str) -> str:
    """A stable HTML id for a layer path."""
    return "layer-" + (re.sub(r"[^A-Za-z0-9_.-]", "_", layer) or "_")


def num(v, digits: int = 4) -> str:
    """A number as a person reads it: 6 decimals for values near 1 (cosine), else ``digits`` significant."""
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
    if 0.9 <= abs(v) <= 1.0:
        return f"{v:.6f}"
    return f"{v:.{digits}g}"


def table(rows: Sequence, columns: Sequence[tuple], cls: Optional[Callable] = None, name: str = "") -> str:
    """``columns``: (header, cell) pairs, ``cell(row)`` -> text (escaped here) or ``("html", raw)``;
    the first column is left-aligned, like any header starting with ``<``. ``cls(row, header)``
    may give a cell's CSS class; ``name`` is the table's class (what tests and styles select)."""
    def cell(row, i, header, fn):
        v = fn(row)
        raw = v[1] if isinstance(v, tuple) and v and v[0] == "html" else esc(v if isinstance(v, str) else num(v))
        klass = ["l"] if i == 0 or header.startswith("<") else []
        extra = cls(row, header) if cls else None
        if extra:
            klass.append(extra)
        return f'<td class="{" ".join(klass)}">{raw}</td>' if klass else f"<td>{raw}</td>"

    head = "".join(f'<th class="l">{esc(h.lstrip("<"))}</th>' if i == 0 or h.startswith("<") else f"<th>{esc(h)}</th>"
                   for i, (h, _) in enumerate(columns))
    body = "".join("<tr>" + "".join(cell(r, i, h, fn) for i, (h, fn) in enumerate(columns)) + "</tr>" for r in rows)
    return f'<table class="{esc(name)}"><tr>{head}</tr>{body}</table>' if name else f"<table><tr>{head}</tr>{body}</table>"


def img(uri: str, alt: str) -> str:
    return f'<img alt="{esc(alt)}" src="{uri}">'


def verdict_box(kind: str, lines: list) -> str:
    """``kind``: pass / warn / fail / none; ``lines``: sentences (plain text)."""
    return f'<div class="verdict {kind}">' + "".join(f"<p>{esc(s)}</p>" for s in lines) + "</div>"


def histogram_rows(order: list, info: dict, weights: dict, acts: dict) -> str:
    """One row per layer in ``order``: what it is and how wrong, its weight histogram, the
    histograms of the tensors entering its activation quantizers. ``info[layer]`` -> html text;
    ``weights[layer]`` -> image html; ``acts[layer]`` -> list of image html."""
    out = ['<div class="hhead"><span>Layer (worst first)</span><span>Weight histograms</span>'
           "<span>Activation histograms (first batch)</span></div>"]
    for layer in order:
        w = weights.get(layer)
        a = acts.get(layer, [])
        if w is None and not a:
            continue
        cells = [f'<div class="info" id="{anchor(layer)}">{info.get(layer, esc(layer))}</div>',
                 w if w is not None else '<div class="empty">no quantized weight</div>']
        cells += a or ['<div class="empty">no activation quantizer</div>']
        out.append('<div class="hrow">' + "".join(cells) + "</div>")
    return "".join(out)


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>'
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")
