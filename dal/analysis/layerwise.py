"""layerwise(float_model, qat_model, data): how far each quantized layer's output is from float.

What is compared, per QAT module (a ``dal.nn.QATModule``) at path ``p`` of the QAT model:

* the QAT module's output: after its fused activation and its output quantizer, if any;
* against the float model's module at the same path ``p`` (same input batch, each model fed
  its own upstream activations, so the error is the accumulated one the network really sees);
* a fused ``QConvBn2d`` / ``QConvBnReLU2d`` at ``p`` (the conv's path) is compared with the
  output of the float model's BatchNorm that was folded into it (found in the prepare report,
  ``"fused with <bn path>"``, else the first BatchNorm registered after the conv), with the
  fused activation (ReLU) applied to it: exactly the point where the fused op ends;
* a layer with no float module at its path (``QAdd`` / ``QCat`` / ``QMatMul`` made from a
  functional ``+`` / ``torch.cat`` / ``@``) is compared with the QAT model itself run with every
  quantizer off; so is every layer when ``float_model`` is None. The ``reference`` column says
  which applies.

Metrics are those of ``dal.analysis.metrics.ErrorStats`` (cosine, MSE, PSNR, MAE, max abs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from torch import nn

from ..calibration.batches import cached_inputs, run_model
from ..nn.base import apply_activation
from ..nn.base import QATModule
from ..prepare.handle import find_prepared
from ..prepare.state import quantizers
from .common import active_layers, evaluating, switch
from .metrics import ErrorStats


@dataclass
class LayerwiseReport:
    """``rows``: one plain dict per layer (layer, type, reference, cosine, mse, psnr, mae, max_abs,
    elements), in execution order; ``notes``: layers that could not be compared, and why."""

    rows: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def worst(self, k: int = 5, key: str = "cosine") -> list:
        return sorted(self.rows, key=lambda r: r[key])[:k]

    def __str__(self) -> str:
        width = max([len(r["layer"]) for r in self.rows] + [5])
        lines = [f"dal.analysis.layerwise: {len(self.rows)} layer(s), output error against float",
                 f"{'layer':<{width}}  {'type':<16} {'cosine':>9} {'PSNR dB':>8} {'MSE':>10} {'MAE':>10} "
                 f"{'max abs':>10}  reference"]
        for r in self.rows:
            lines.append(f"{r['layer']:<{width}}  {r['type'][:16]:<16} {r['cosine']:>9.6f} {r['psnr']:>8.2f} "
                         f"{r['mse']:>10.3e} {r['mae']:>10.3e} {r['max_abs']:>10.3e}  {r['reference']}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fused_bn_path(qat_model: nn.Module, float_model: nn.Module, path: str) -> Optional[str]:
    handle = find_prepared(qat_model)
    report = handle.report if handle is not None else None
    for row in getattr(report, "rows", ()):
        if row.name == path:
            m = re.search(r"fused with (\S+?)(;|\s|$)", row.detail or "")
            if m:
                return m.group(1)
    names = [n for n, _ in float_model.named_modules()]
    if path in names:
        for name in names[names.index(path) + 1:]:
            if isinstance(float_model.get_submodule(name), nn.modules.batchnorm._BatchNorm):
                return name
    return None


def _plan(float_model, qat_model, layers):
    """Per layer: (float path or None for 'self', activation to apply, reference label)."""
    float_mods = dict(float_model.named_modules()) if float_model is not None else {}
    plan = {}
    for path, mod in layers:
        act = getattr(mod, "activation", None)
        if float_model is not None and hasattr(mod, "bn") and hasattr(mod, "folded_weight_and_bias"):
            bn = _fused_bn_path(qat_model, float_model, path)
            if bn in float_mods:
                plan[path] = (bn, act, f"float {bn}" + (f" + {act}" if act else ""))
                continue
        if path in float_mods and not isinstance(float_mods[path], QATModule):
            plan[path] = (path, act, f"float {path}" + (f" + {act}" if act else ""))
        else:
            plan[path] = (None, None, "qat, quantizers off")
    return plan


def _hook_outputs(model: nn.Module, paths: Iterable[str], store: dict) -> list:
    # A copy: a residual ``out += identity`` after the layer would otherwise change the stored output.
    hooks = []
    for p in set(paths):
        mod = model.get_submodule(p)
        hooks.append(mod.register_forward_hook(
            lambda m, i, o, p=p: store.setdefault(p, []).append(o.detach().clone()) if hasattr(o, "detach") else None))
    return hooks


def _run_capturing(model, paths, args, kwargs, index) -> dict:
    store: dict = {}
    hooks = _hook_outputs(model, paths, store)
    try:
        run_model(model, args, kwargs, index)
    finally:
        for h in hooks:
            h.remove()
    return store


def layerwise(float_model: Optional[nn.Module], qat_model: nn.Module, data: Iterable, num_batches: Optional[int] = 8,
              *, input_fn: Optional[Callable] = None, progress: bool = True) -> LayerwiseReport:
    """Per-layer output error of ``qat_model`` (calibrated or trained) against ``float_model``.

    See the module docstring for what is compared with what. Both models run in eval mode on the
    first ``num_batches`` batches of ``data``; their modes and quantizer states are restored.

    Example:
        >>> rep = dal.analysis.layerwise(float_model, qat_model, loader, num_batches=4)  # doctest: +SKIP
        >>> print(rep); rep.rows[0]["cosine"]                                            # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    if float_model is qat_model:
        float_model = None  # prepared in place: there is no separate float model to compare with
    layers = active_layers(qat_model)
    if not layers:
        raise ValueError("layerwise: the model has no active QAT layer (prepare_qat and calibrate it first)")
    plan = _plan(float_model, qat_model, layers)
    stats = {p: ErrorStats() for p, _ in layers}
    notes: dict = {}
    inputs = cached_inputs(data, num_batches, input_fn=input_fn, desc="dal.analysis.layerwise")
    all_q = [q for _, q in quantizers(qat_model)]
    self_paths = [p for p, (fp, _, _) in plan.items() if fp is None]
    float_paths = [fp for fp, _, _ in plan.values() if fp is not None]
    order: list = []
    with evaluating(qat_model, float_model):
        for i, (args, kwargs) in enumerate(tqdm(inputs, desc="dal.analysis.layerwise", disable=not progress,
                                                leave=False)):
            ref = _run_capturing(float_model, float_paths, args, kwargs, i) if float_paths else {}
            if self_paths:
                states = {q: q.state for q in all_q}
                switch(all_q, "off")
                try:
                    off = _run_capturing(qat_model, self_paths, args, kwargs, i)
                finally:
                    for q, s in states.items():
                        switch([q], s)
            else:
                off = {}
            got = _run_capturing(qat_model, stats, args, kwargs, i)
            if not order:
                order = list(got)  # hooks fire in execution order
            for path in stats:
                fp, act, _ = plan[path]
                refs = off.get(path, []) if fp is None else [apply_activation(r, act) for r in ref.get(fp, [])]
                outs = got.get(path, [])
                if not outs or not refs:
                    notes[path] = f"{path}: did not run on these inputs" if not outs else \
                        f"{path}: its float counterpart did not run"
                    continue
                for o, r in zip(outs, refs):
                    if o.shape != r.shape:
                        notes[path] = f"{path}: output shape {tuple(o.shape)} differs from the float {tuple(r.shape)}"
                        continue
                    stats[path].add(o, r)
    kinds = dict(layers)
    rows = []
    for path in order + [p for p, _ in layers if p not in order]:
        if stats[path].n == 0:
            continue
        rows.append({"layer": path, "type": type(kinds[path]).__name__, "reference": plan[path][2],
                     **stats[path].as_dict()})
    return LayerwiseReport(rows, list(notes.values()))
