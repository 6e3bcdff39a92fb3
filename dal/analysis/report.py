"""build_report: one self-contained HTML file about a QAT model (``dal report`` / ``dal.report``).

What a person reads, in order (short sections first, the one-row-per-layer ones last):

1. **Summary**: the parity verdict (``ParityReport.verdict()``, the one ``dal verify --strict``
   and the printed report give, naming the layer at fault when it fails) when an ONNX file is
   given, the end-to-end output cosine vs float against ``cosine_target``, the layers with the
   largest quantization error (per-layer output cosine vs float, ``layerwise``: not parity),
   and parity in one table: the verdict's rows, then the end-to-end ones reported with cosine
   (``report_parity``).
2. **Parity** detail: the layers that differ (near-ties and not), first divergences, every
   layer's cosine (NPU vs the other engine, and vs the float model), dal.verify's text report.
3. **Sensitivity** of the ``sensitivity_layers`` worst layers (``sensitivity`` costs 2 passes over
   the data per layer: of every layer it dominated the report's time).
4. **Per-layer output error** of every layer (bars in execution order, table with the rank).
5. **Histograms, worst layers first**: per layer its weight and the tensors entering its
   activation quantizers, with each quantizer's clipping range (``report_panels``).
6. What ``prepare_qat`` did (folded).

Images are PNGs embedded as ``data:`` URIs: the file can be mailed or attached to a CI run and
opens anywhere, with nothing to fetch.
"""
from __future__ import annotations

import contextlib
import html
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..calibration.batches import cached_inputs
from ..prepare.handle import find_prepared
from ..prepare.state import quantizers
from . import report_html as H
from .common import active_layers, evaluating
from .report_panels import activation_panels, clip_range, weight_panels, worst_first

__all__ = ["build_report", "clip_range"]


def _cached(batch):
    return batch  # batches already unpacked to (args, kwargs) by cached_inputs


def build_report(model: nn.Module, data: Optional[Iterable] = None, float_model: Optional[nn.Module] = None,
                 onnx_path=None, out="report.html", *, num_batches: int = 4, sensitivity: bool = True,
                 sensitivity_layers: Optional[int] = 5, input_fn: Optional[Callable] = None,
                 title: Optional[str] = None, max_histograms: Optional[int] = None, worst: int = 5,
                 cosine_target: float = 0.99, progress: bool = True, auto_quantize=None, estimate=None,
                 search=None) -> Path:
    """Write the HTML report of a calibrated / trained QAT ``model`` to ``out``; return its path.

    Args:
        data: batches to analyse (layer-wise error, activation histograms, sensitivity and the
            parity inputs need it; without it only the weight histograms are made).
        float_model: the float model for ``layerwise`` (default: ``model`` with quantizers off).
        onnx_path: an exported QDQ ONNX file: ``dal.verify`` on the first batch's first 16 samples
            (as many as the file's batch size when it is fixed).
        sensitivity: include the sensitivity ranking, of the ``sensitivity_layers`` layers with
            the largest per-layer error (None: every layer; 2 L + 2 passes over ``num_batches``).
        max_histograms: histograms of this many layers, worst first (None: every layer).
        worst: how many of the worst layers the summary names.
        cosine_target: the end-to-end output cosine vs float the verdict asks for.
        auto_quantize: a ``dal.auto_quantize`` result: its rung table becomes a section.
        estimate: a ``dal.estimate`` result: the latency section (plot per layer, engines);
            ``search``: a ``dal.search_precision`` result adds its Pareto front there.

    Example:
        >>> dal.analysis.report.build_report(qat, loader, float_model=net, onnx_path="m.onnx")  # doctest: +SKIP
    """
    from . import plots

    plots.require_matplotlib("build_report")  # fail fast: before minutes of analysis
    t0 = time.perf_counter()
    inputs = cached_inputs(data, num_batches, input_fn=input_fn) if data is not None else []
    f = _analyse(model, inputs, float_model, onnx_path, sensitivity, sensitivity_layers, progress)
    drawable = [n for n in f.order if n in f.weights or n in f.acts]
    shown = drawable[:max_histograms]  # histograms, worst first
    drawn = set(shown)
    with _timed(f.took, "figures"):
        # The short sections first, the one-per-layer ones after.
        body = [_summary(f.order, f.rows, f.weights, drawn, {r["layer"]: r for r in f.sens.rows} if f.sens else {},
                         f.end_cosine, cosine_target, f.parity, worst, inputs)]
        if auto_quantize is not None:
            body.append(auto_quantize.to_html())
        if estimate is not None:
            from .report_cost import latency_section

            body.append(latency_section(estimate, search))
        if onnx_path is not None:
            body.append(_parity_section(f.parity))
        if f.sens is not None:
            body.append(_sensitivity_section(f.sens, len(f.layers), drawn, plots))
        if f.lw is not None:
            body.append(_error_section(f.lw, f.rank, drawn, plots))
        body.append(_histogram_section(shown, len(drawable) - len(shown), f.rows, f.rank, f.weights, f.acts, plots))
        if f.prep is not None:
            body.append('<h2 id="prepare">What prepare_qat did</h2><details><summary>every module and functional '
                        f"op: quantized, fused, or left in float and why</summary><pre>{H.esc(str(f.prep))}</pre>"
                        "</details>")
    title = title or f"dal report: {type(model).__name__}"
    meta = (f"model {type(model).__name__}; recipe {getattr(f.prep, 'recipe', '?')}; hardware "
            f"{getattr(f.prep, 'hardware', '?')}; {len(f.layers)} quantized layers, "
            f"{sum(1 for _ in quantizers(model))} quantizers; {_batches(inputs)}. Built in "
            f"{time.perf_counter() - t0:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in f.took.items()) + ").")
    links = [("summary", "Summary", True), ("auto-quantize", "auto_quantize", auto_quantize is not None),
             ("latency", "Latency", estimate is not None),
             ("parity", "Parity", onnx_path is not None),
             ("sensitivity", "Sensitivity", f.sens is not None), ("error", "Per-layer error", f.lw is not None),
             ("histograms", "Histograms", True), ("prepare", "prepare_qat", f.prep is not None)]
    nav = "<nav>" + "".join(f'<a href="#{a}">{t}</a>' for a, t, on in links if on) + "</nav>"
    path = Path(out)
    path.write_text(H.page(title, f'<h1>{H.esc(title)}</h1><p class="meta">{H.esc(meta)}</p>{nav}' + "".join(body)),
                    encoding="utf-8")
    return path


@dataclass
class _Findings:
    """What the report shows, measured once; ``took``: seconds per step, shown in the report."""

    layers: list
    prep: object = None
    lw: object = None            # LayerwiseReport
    rows: dict = field(default_factory=dict)    # layer -> layerwise row
    order: list = field(default_factory=list)   # layer paths, worst first
    rank: dict = field(default_factory=dict)    # layer -> 1-based rank (measured layers)
    weights: dict = field(default_factory=dict)  # layer -> Panel
    acts: dict = field(default_factory=dict)     # layer -> [Panel]
    sens: object = None          # SensitivityReport
    end_cosine: Optional[float] = None
    parity: object = None        # ParityReport, or the text of why it could not run
    took: dict = field(default_factory=dict)


@contextlib.contextmanager
def _timed(took: dict, key: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        took[key] = took.get(key, 0.0) + time.perf_counter() - t


def _analyse(model, inputs, float_model, onnx_path, sensitivity, sensitivity_layers, progress) -> _Findings:
    handle = find_prepared(model)
    f = _Findings(active_layers(model), handle.report if handle is not None else None)
    names = [n for n, _ in f.layers]
    if inputs:
        from .layerwise import layerwise

        with _timed(f.took, "layerwise"):
            f.lw = layerwise(float_model, model, inputs, None, input_fn=_cached, progress=progress)
        f.rows = {r["layer"]: r for r in f.lw.rows}
    f.order = worst_first(names, f.lw.rows if f.lw is not None else None)
    f.rank = {n: i for i, n in enumerate(f.order, 1) if n in f.rows}
    with _timed(f.took, "histograms"):
        f.weights = weight_panels(f.layers)
        if inputs:
            with evaluating(model):
                f.acts = activation_panels(model, *inputs[0], names)
    if inputs and sensitivity:
        from .sensitivity import sensitivity as run_sensitivity

        measured = [n for n in f.order if n in f.rows]
        chosen = measured[:sensitivity_layers] if sensitivity_layers is not None else None
        with _timed(f.took, "sensitivity"):
            f.sens = run_sensitivity(model, inputs, "cosine", None, layers=chosen, input_fn=_cached,
                                     progress=progress)
        f.end_cosine = f.sens.all_quantized
    elif inputs:
        from .evaluator import Evaluator

        with _timed(f.took, "output cosine"), evaluating(model):
            f.end_cosine = Evaluator(model, inputs, "cosine", None, _cached)()
    if onnx_path is not None:
        with _timed(f.took, "parity"):
            f.parity = _run_parity(model, onnx_path, inputs)
    return f


def _batches(inputs) -> str:
    if not inputs:
        return "no data"
    shapes = sorted({"x".join(map(str, a.shape)) for args, _ in inputs for a in args if torch.is_tensor(a)})
    return f"{len(inputs)} batch(es) of {', '.join(shapes)}"


def _file_batch(onnx_path) -> list:
    """The fixed batch size of each graph input of the file (None where dynamic or unreadable)."""
    import onnx

    try:
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - dal.verify names what is wrong with the file
        return []
    weights = {i.name for i in graph.initializer}
    sizes = []
    for gi in graph.input:
        if gi.name not in weights:
            dims = gi.type.tensor_type.shape.dim
            sizes.append(dims[0].dim_value if dims and dims[0].HasField("dim_value") else None)
    return sizes


def _run_parity(model, onnx_path, inputs):
    """The ParityReport of the first batch's first 16 samples (or as many as the file's fixed batch
    size), or the error text it raised."""
    from ..verification import verify

    if not inputs:
        return "no data given: pass data to run dal.verify on it"
    args, _ = inputs[0]
    sizes = _file_batch(onnx_path)
    # An export has a fixed batch size unless made with dynamic_batch=True: feed it exactly that.
    args = tuple(a[:(sizes[i] if i < len(sizes) and sizes[i] else 16)] if torch.is_tensor(a) else a
                 for i, a in enumerate(args))
    from ..verification.inputs import VerifyInputError

    try:
        return verify(str(onnx_path), model, args)
    except (VerifyInputError, FileNotFoundError):
        raise  # a wrong --onnx file is the caller's to fix, not a line inside a finished report
    except Exception as err:  # noqa: BLE001 - the report says what failed instead of failing whole
        return f"dal.verify failed: {type(err).__name__}: {err}"


# ---- sections ------------------------------------------------------------------------------------

def _link(layer: str, drawn) -> str:
    """The layer's name, linked to its histograms where it has any."""
    name = H.esc(layer)
    return f'<a href="#{H.anchor(layer)}">{name}</a>' if layer in drawn else name


def _summary(order, rows, weights, drawn, gains, end_cosine, target, parity, worst, inputs) -> str:
    from .report_parity import parity_rows, verdict

    lines, kinds = [], []
    if end_cosine is not None:
        ok = end_cosine >= target
        kinds.append("pass" if ok else "warn")
        lines.append(f"Output cosine vs float (the model with its quantizers off) {end_cosine:.6f}: "
                     f"{'meets' if ok else 'BELOW'} the target {target:g}" +
                     ("." if ok else "; the worst layers are listed below, and dal.analysis.auto_fallback finds the "
                                     "fewest to keep in FP16."))
    if isinstance(parity, str):
        kinds.append("fail")
        lines.append(f"Parity not checked: {parity}")
    elif parity is not None:
        kind, text = verdict(parity)
        kinds.append(kind)
        lines.insert(0, text)  # the verdict first (integer model == NPU, layer by layer)
    if not inputs:
        lines.append("No data given: only weight histograms. Pass data for per-layer error, activation histograms, "
                     "sensitivity and parity.")
    kind = next((k for k in ("fail", "warn", "pass") if k in kinds), "none")
    out = ['<h2 id="summary">Summary</h2>', H.verdict_box(kind, lines)]
    measured = [n for n in order if n in rows][:worst]
    if measured:
        cols = [("#", lambda n: str(order.index(n) + 1)), ("<layer", lambda n: ("html", _link(n, drawn))),
                ("<type", lambda n: rows[n]["type"]),
                ("cosine", lambda n: rows[n]["cosine"]), ("PSNR dB", lambda n: rows[n]["psnr"]),
                ("max abs err", lambda n: rows[n]["max_abs"]),
                ("<weight", lambda n: weights[n].fmt if n in weights else "-"),
                ("weights clipped", lambda n: _pct(weights[n].clipped) if n in weights else "-")]
        if gains:
            cols.append(("sensitivity gain", lambda n: gains[n]["gain"] if n in gains else "-"))
        out.append(f"<h3>Quantization error, not parity: worst layers by per-layer output cosine vs float "
                   f"({len(rows)} layers measured)</h3><p class=\"note\">How far each layer's quantized output is "
                   "from the float model's (what quantization costs); it says nothing about whether the NPU computes "
                   "what was trained: the parity verdict above does, naming the layer at fault.</p>" +
                   H.table(measured, cols, name="worst"))
    if parity is not None and not isinstance(parity, str):
        out.append(f"<h3>Parity (requantizer: {H.esc(parity.requantizer)}; codes = LSBs of each tensor's scale)</h3>" +
                   H.table(parity_rows(parity), [
                       ("<view", lambda r: r.view), ("<compared", lambda r: r.compared), ("<what", lambda r: r.what),
                       ("codes differing", lambda r: f"{r.differ}/{r.elements}"),
                       ("near-ties", lambda r: "-" if r.near_ties is None else str(r.near_ties)),
                       ("fraction", lambda r: f"{r.fraction:.2g}"),
                       ("within 1 LSB", lambda r: "-" if r.within is None else f"{100 * r.within:.4g}%"),
                       ("max LSB", lambda r: "-" if r.max_lsb is None else f"{r.max_lsb:.3g}"),
                       ("cosine", lambda r: "-" if r.cosine is None else f"{r.cosine:.6f}"),
                       ("<required", lambda r: r.bound), ("<status", lambda r: r.status)],
                       cls=lambda r, h: _STATUS.get(r.status, "warn") if h == "<status" else None, name="parity"))
    return "".join(out)


_STATUS = {"pass": "pass", "fail": "fail", "info": "info"}  # anything else: a pass with a caveat


def _pct(v: float) -> str:
    return "-" if v != v else (f"{100 * v:.3g}%" if v else "0")


def _error_section(lw, rank, drawn, plots) -> str:
    cols = [("<layer", lambda r: ("html", _link(r["layer"], drawn))),
            ("rank", lambda r: str(rank.get(r["layer"], "-"))), ("<type", lambda r: r["type"])]
    cols += [(h, lambda r, k=k: r[k]) for h, k in (("cosine", "cosine"), ("PSNR dB", "psnr"), ("MSE", "mse"),
                                                    ("MAE", "mae"), ("max abs", "max_abs"))]
    cols.append(("<reference", lambda r: r["reference"]))
    return ('<h2 id="error">Per-layer output error</h2><p>Each quantized layer\'s output against the float model\'s '
            "at the same point (fused Conv+BN(+ReLU): after BN and the activation), in execution order; rank 1 is "
            "the worst.</p>" + H.img(plots.layer_error_bars(lw.rows), "per-layer error") +
            "<details><summary>the table</summary>" + H.table(lw.rows, cols, name="layers") + "</details>" +
            "".join(f'<p class="note">note: {H.esc(n)}</p>' for n in lw.notes))


def _histogram_section(shown, left, rows, rank, weights, acts, plots) -> str:
    plotter = plots.HistogramPlotter()

    def render(p):
        note = f"; clipped {_pct(p.clipped)}" if p.clipped == p.clipped else ""
        if p.nonfinite:
            note += f"; {p.nonfinite} non-finite"
        return H.img(plotter.plot(p.counts, p.edges, p.ranges, p.title + note), f"{p.layer}: {p.title}")

    info = {}
    for n in shown:
        r = rows.get(n)
        text = f"<b>{H.esc(n)}</b>"
        if r is not None:
            text += (f"<br>#{rank[n]} {H.esc(r['type'])}<br>cosine {H.num(r['cosine'])}, "
                     f"PSNR {H.num(r['psnr'])} dB<br>max abs err {H.num(r['max_abs'])}")
        info[n] = text
    body = H.histogram_rows(shown, info, {n: render(weights[n]) for n in shown if n in weights},
                            {n: [render(p) for p in acts[n]] for n in shown if n in acts})
    other = acts.get("", [])
    if other:
        body += "<h3>Activation quantizers outside any layer</h3><div class=\"hrow\">" + \
            "".join(render(p) for p in other) + "</div>"
    return ('<h2 id="histograms">Histograms with clipping ranges, worst layers first</h2><p>Grey: counts (log '
            "scale); red: the quantizer's clipping range (per channel or group: widest solid, median dashed); "
            "clipped: share of values outside it. Conv+BN weights are folded; activations are the tensors "
            "entering each activation quantizer on the first batch.</p>" + body +
            (f'<p class="note">{left} more layer(s) not shown (max_histograms={len(shown)}).</p>' if left else ""))


def _sensitivity_section(sens, n_layers, drawn, plots) -> str:
    scope = (f"the {len(sens.rows)} layers with the largest per-layer error (of {n_layers}; "
             "build_report(sensitivity_layers=None) for all)" if len(sens.rows) < n_layers else "every layer")
    return ('<h2 id="sensitivity">Sensitivity</h2>'
            f"<p>Of {scope}. Output cosine vs float, all quantized: {sens.all_quantized:.6f}. drop: output cosine "
            "lost when only this layer is quantized; gain: cosine won back when only this layer is left in float.</p>"
            + H.img(plots.sensitivity_bars(sens.ranked), "sensitivity") +
            H.table(sens.ranked, [("<layer", lambda r: ("html", _link(r["layer"], drawn))),
                                  ("<type", lambda r: r["type"]), ("only quantized", lambda r: r["only_quantized"]),
                                  ("drop", lambda r: r["drop"]), ("only float", lambda r: r["only_float"]),
                                  ("gain", lambda r: r["gain"])], name="sensitivity"))


def _parity_section(parity) -> str:
    from .report_parity import differing_layers

    head = '<h2 id="parity">Parity: NPU reference vs torch and onnxruntime</h2>'
    if isinstance(parity, str):
        return head + f"<pre>{H.esc(parity)}</pre>"
    parts = [head, "<p>End to end, each engine runs on its own upstream values, so one near-tie flip in an early "
             "layer can cascade: reported, not part of the verdict. Layer by layer, each layer runs from the other "
             "engine's quantized inputs and may differ only on near-ties: each differing code is 1 LSB off and its "
             "exact value lies within the float32 accumulation-error bound of the boundary between the two codes "
             "(dal.verification.near_tie).</p>"]
    if parity.first_failure():
        parts.append(f"<p><b>First layer at fault:</b> {H.esc(parity.first_failure())}</p>")
    cols = [("<tensor", lambda r: r["tensor"]), ("<layer", lambda r: r["layer"]), ("<node", lambda r: r["node"]),
            ("codes differing", lambda r: r["differ"]), ("near-ties", lambda r: r["near-ties"]),
            ("not near-ties", lambda r: r["not near-ties"]), ("max LSB", lambda r: r["max LSB"]),
            ("cosine", lambda r: r["cosine"])]
    for label, rows, first in (("NPU reference from onnxruntime's inputs", parity.layers_forced,
                                parity.first_forced_divergence),
                               ("torch QAT from the NPU reference's values", parity.torch_layers, None),
                               ("end to end, NPU reference vs onnxruntime (cascades)", parity.layers,
                                parity.first_divergence)):
        if not rows:
            continue
        bad = differing_layers(rows)
        n_bad = sum(1 for r in rows if r.differ)
        parts.append(f"<h3>{H.esc(label)}: {n_bad} of {len(rows)} differ</h3>")
        if first:
            parts.append(f"<p>first divergence: {H.esc(first)}</p>")
        if bad:
            parts.append(H.table(bad, cols) + (f'<p class="note">the {len(bad)} largest of {n_bad} shown</p>'
                                               if len(bad) < n_bad else ""))
    every = parity.layer_rows()
    if every:
        parts.append("<details><summary>every layer's cosine (float64, dequantized): NPU vs the other engine, and "
                     "NPU vs the torch float model</summary>" + H.table(every, [
                         ("<tensor", lambda r: r.tensor), ("<layer", lambda r: r.layer or "-"),
                         ("cosine", lambda r: "-" if r.cosine is None else f"{r.cosine:.6f}"),
                         ("cosine vs float", lambda r: "-" if r.float_cosine is None else f"{r.float_cosine:.6f}")],
                         name="layer-cosine") + "</details>")
    parts.append(f"<details><summary>dal.verify's text report</summary><pre>{html.escape(str(parity))}</pre></details>")
    return "".join(parts)
