"""build_report: one self-contained HTML file about a QAT model (``dal report`` / ``dal.report``).

Sections (each only when its inputs are given): a text summary; per-layer output error
(``layerwise``: table and bars); weight histograms with each weight quantizer's clipping range;
activation histograms (one batch, the tensor entering each activation quantizer) with its
clipping range; the sensitivity ranking; the parity summary of an exported ONNX file
(``dal.verify``). Images are PNGs embedded as ``data:`` URIs: the file can be mailed or attached
to a CI run and opens anywhere, with nothing to fetch.

Clipping range of a quantizer with scale ``s`` and zero point ``z``: integers
``[s (q_min - z), s (q_max - z)]``; FP8 ``[-s m, s m]`` with ``m`` the format's largest finite value.
Per channel the widest range is drawn solid and the median channel's dashed.
"""
from __future__ import annotations

import argparse
import html
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..calibration.batches import cached_inputs, run_model
from ..prepare.handle import find_prepared
from ..prepare.state import quantizers
from .common import active_layers, evaluating


def _cached(batch):
    return batch  # batches already unpacked to (args, kwargs) by cached_inputs


def clip_range(q) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per scale element of a calibrated scaled quantizer (see the module docstring)."""
    s, z = q.effective_qparams()
    s = s.float()
    if q.fmt.is_float8:
        return -s * q.fmt.max_value, s * q.fmt.max_value
    z = z.float()  # a learnable zero point rounded, as the forward rounds it
    return s * (q.qmin - z), s * (q.qmax - z)


def _ranges(q) -> list:
    lo, hi = clip_range(q)
    if lo.numel() == 1:
        return [(float(lo), float(hi), "-")]
    width = (hi - lo).flatten()
    mid = int(width.argsort()[len(width) // 2])
    return [(float(lo.min()), float(hi.max()), "-"), (float(lo.flatten()[mid]), float(hi.flatten()[mid]), "--")]


def _weight_panels(layers, limit: int) -> list:
    panels = []
    for name, mod in layers:
        q = getattr(mod, "weight_quant", None)
        if q is None or not q.fmt.is_scaled or not q.initialized:
            continue
        w = mod.folded_weight_and_bias()[0] if hasattr(mod, "folded_weight_and_bias") else mod.weight
        panels.append((f"{name} ({q.fmt.name})", w.detach().float().flatten().numpy(), _ranges(q)))
        if len(panels) >= limit:
            break
    return panels


def _keep(seen: dict, name: str, q, x) -> None:
    # A pre-hook's return value would replace the input: return None explicitly.
    seen.setdefault(name, (q, x.detach().float().flatten()))
    return None


def _activation_panels(model, args, kwargs, limit: int) -> list:
    seen: dict = {}
    hooks = []
    for name, q in quantizers(model):
        if q.fmt.is_scaled and q.initialized and q.state in ("quantize", "frozen") and "weight_quant" not in name:
            hooks.append(q.register_forward_pre_hook(lambda m, a, name=name: _keep(seen, name, m, a[0])))
    try:
        run_model(model, args, kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [(f"{n} ({q.fmt.name})", x.numpy(), _ranges(q)) for n, (q, x) in list(seen.items())[:limit]]


def _table(rows: list, columns: list) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"<td>{v:.6g}</td>" if isinstance(v, float) else f"<td>{html.escape(str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _img(uri: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="{uri}">'


_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:12px}"
          "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#eee}"
          "td:first-child{text-align:left}pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}"
          "img{max-width:100%}")


def build_report(model: nn.Module, data: Optional[Iterable] = None, float_model: Optional[nn.Module] = None,
                 onnx_path=None, out="report.html", *, num_batches: int = 4, sensitivity: bool = True,
                 input_fn: Optional[Callable] = None, title: Optional[str] = None, max_histograms: int = 24,
                 progress: bool = True) -> Path:
    """Write the HTML report of a calibrated / trained QAT ``model`` to ``out``; return its path.

    Args:
        data: batches to analyse (layer-wise error, activation histograms, sensitivity and the
            parity inputs need it; without it only the summary and weight histograms are made).
        float_model: the float model for ``layerwise`` (default: ``model`` with quantizers off).
        onnx_path: an exported QDQ ONNX file: ``dal.verify`` on the first batch's first 16 samples.
        sensitivity: include the sensitivity ranking (2 L + 2 forward passes of ``num_batches``).

    Example:
        >>> dal.analysis.report.build_report(qat, loader, float_model=net, onnx_path="m.onnx")  # doctest: +SKIP
    """
    from . import plots
    from .layerwise import layerwise
    from .sensitivity import sensitivity as run_sensitivity

    plots.require_matplotlib("build_report")  # fail fast: before minutes of analysis
    t0 = time.time()
    layers = active_layers(model)
    handle = find_prepared(model)
    prep = handle.report if handle is not None else None
    title = title or f"dal report: {type(model).__name__}"
    summary = [f"model: {type(model).__name__}; recipe: {getattr(prep, 'recipe', '?')}; "
               f"hardware: {getattr(prep, 'hardware', '?')}",
               f"quantized layers: {len(layers)}; quantizers: {sum(1 for _ in quantizers(model))}"]
    sections = []
    if prep is not None:
        sections.append(f"<h2>What prepare_qat did</h2><pre>{html.escape(str(prep))}</pre>")
    inputs = cached_inputs(data, num_batches, input_fn=input_fn) if data is not None else []
    if inputs:
        lw = layerwise(float_model, model, inputs, None, input_fn=_cached, progress=progress)
        worst = lw.worst(3)
        summary.append("largest per-layer errors (cosine): " +
                       ", ".join(f"{r['layer']} {r['cosine']:.5f}" for r in worst))
        sections.append("<h2>Per-layer output error</h2><p>Each quantized layer's output against the float "
                        "model's at the same point (fused Conv+BN(+ReLU): after BN and the activation).</p>" +
                        _img(plots.layer_error_bars(lw.rows), "per-layer error") +
                        _table(lw.rows, ["layer", "type", "cosine", "psnr", "mse", "mae", "max_abs", "reference"]) +
                        "".join(f"<p>note: {html.escape(n)}</p>" for n in lw.notes))
    weights = _weight_panels(layers, max_histograms)
    if weights:
        sections.append("<h2>Weight histograms and clipping ranges</h2><p>Red: the quantizer's clipping range "
                        "(per channel: widest solid, median channel dashed). Conv+BN weights are folded.</p>" +
                        _img(plots.histograms(weights, "Weights"), "weight histograms"))
    if inputs:
        with evaluating(model):
            acts = _activation_panels(model, *inputs[0], max_histograms)
        if acts:
            sections.append("<h2>Activation histograms and clipping ranges</h2><p>The tensor entering each "
                            "activation quantizer on the first batch.</p>" +
                            _img(plots.histograms(acts, "Activations (first batch)"), "activation histograms"))
        if sensitivity:
            sens = run_sensitivity(model, inputs, "cosine", None, input_fn=_cached, progress=progress)
            top = sens.ranked[:3]
            summary.append(f"output cosine vs float: {sens.all_quantized:.6f}; most sensitive: " +
                           ", ".join(f"{r['layer']} (drop {r['drop']:.2e})" for r in top))
            sections.append("<h2>Sensitivity</h2><p>drop: output cosine lost when only this layer is quantized; "
                            "gain: cosine won back when only this layer is left in float.</p>" +
                            _img(plots.sensitivity_bars(sens.ranked), "sensitivity") +
                            _table(sens.ranked, ["layer", "type", "only_quantized", "drop", "only_float", "gain"]))
    if onnx_path is not None:
        sections.append(_parity_section(model, onnx_path, inputs, summary))
    summary.append(f"report built in {time.time() - t0:.1f} s")
    body = (f"<h1>{html.escape(title)}</h1><h2>Summary</h2><ul>" +
            "".join(f"<li>{html.escape(s)}</li>" for s in summary) + "</ul>" + "".join(sections))
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
           f"<style>{_STYLE}</style></head><body>{body}</body></html>\n")
    path = Path(out)
    path.write_text(doc, encoding="utf-8")
    return path


def _parity_section(model, onnx_path, inputs, summary) -> str:
    from ..verification import verify

    if not inputs:
        return "<h2>Parity</h2><p>no data given: pass data to run dal.verify on it</p>"
    args, _ = inputs[0]
    args = tuple(a[:16] if torch.is_tensor(a) else a for a in args)
    try:
        rep = verify(str(onnx_path), model, args)
    except Exception as err:  # noqa: BLE001 - the report says what failed instead of failing whole
        summary.append(f"parity: dal.verify failed: {type(err).__name__}: {err}")
        return f"<h2>Parity</h2><pre>dal.verify failed: {html.escape(f'{type(err).__name__}: {err}')}</pre>"
    rows = []
    for name, pairs in rep.outputs.items():
        for pair, a in pairs.items():
            rows.append({"output": name, "pair": pair, "elements": a.elements, "identical": a.identical,
                         "1 LSB": a.off_by_one, ">1 LSB": a.off_by_more, "cosine": a.cosine, "psnr": a.psnr})
    summary.append(f"parity ({rep.requantizer} requantizer): bit-exact vs onnxruntime: {rep.bit_exact_vs_ort}")
    return ("<h2>Parity: NPU reference vs torch and onnxruntime</h2>" +
            _table(rows, ["output", "pair", "elements", "identical", "1 LSB", ">1 LSB", "cosine", "psnr"]) +
            f"<pre>{html.escape(str(rep))}</pre>")


def _shape(text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.replace("x", ",").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 1,3,224,224") from None


def main(argv=None) -> int:
    """``dal report``: the HTML report of a dal checkpoint (see ``--help``)."""
    p = argparse.ArgumentParser(prog="dal report", description="Write one self-contained HTML report of a QAT "
                                "model: per-layer error, histograms with clipping ranges, sensitivity, parity.")
    p.add_argument("--model", required=True, help="model factory package.module:function (the float model)")
    p.add_argument("--checkpoint", required=True, help="dal checkpoint (dal.save_checkpoint) of the QAT model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="package.module:function returning an iterable of batches")
    src.add_argument("--random-input", type=_shape, metavar="SHAPE", help="N(0,1) batches of this shape")
    p.add_argument("--onnx", help="exported QDQ ONNX file: adds the dal.verify parity summary")
    p.add_argument("--out", default="report.html", help="output file (default report.html)")
    p.add_argument("--num-batches", type=int, default=4, help="batches analysed (default 4)")
    p.add_argument("--no-sensitivity", action="store_true", help="skip the sensitivity ranking")
    p.add_argument("--seed", type=int, default=0, help="seed for --random-input")
    args = p.parse_args(argv)
    from ..checkpoint import load_checkpoint, resolve_factory

    if args.data:
        data = resolve_factory(args.data)()
        example = cached_inputs(data, 1)[0][0]
    else:
        g = torch.Generator().manual_seed(args.seed)
        data = [torch.randn(args.random_input, generator=g) for _ in range(args.num_batches)]
        example = (data[0],)
    model = load_checkpoint(args.checkpoint, args.model, example_inputs=tuple(example))
    path = build_report(model, data, None, args.onnx, args.out, num_batches=args.num_batches,
                        sensitivity=not args.no_sensitivity, progress=False)
    print(f"wrote {path}")
    return 0
