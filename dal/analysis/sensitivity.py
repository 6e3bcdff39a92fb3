"""sensitivity(model, data): which layers hurt the end-to-end metric most when quantized.

Two one-at-a-time experiments per quantized layer ``l`` (``M`` = the metric, see
``evaluator.py``; ``Q`` = every layer quantized, ``F`` = every quantizer off):

    drop_l = M(F) - M(only l quantized)       the damage ``l`` does on its own
    gain_l = M(Q with l in float) - M(Q)      what keeping ``l`` in float buys back

``drop`` ranks layers in isolation; ``gain`` accounts for the others being quantized too and
is the ranking the automatic FP16 fallback uses. 2 L + 2 metric evaluations for L layers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from torch import nn

from ..prepare.state import quantizers
from .common import active_layers, evaluating, layer_quantizers, switch
from .evaluator import Evaluator, Metric


@dataclass
class SensitivityReport:
    """``rows`` (plain dicts: layer, type, only_quantized, drop, only_float, gain) in execution-
    independent registration order; ``ranked`` by drop, ``ranked_by_gain`` by gain (largest first)."""

    metric: str
    all_quantized: float
    all_float: float
    rows: list = field(default_factory=list)

    @property
    def ranked(self) -> list:
        return sorted(self.rows, key=lambda r: -r["drop"])

    @property
    def ranked_by_gain(self) -> list:
        return sorted(self.rows, key=lambda r: (-r["gain"], -r["drop"]))

    def __str__(self) -> str:
        width = max([len(r["layer"]) for r in self.rows] + [5])
        lines = [f"dal.analysis.sensitivity ({self.metric}): all quantized {self.all_quantized:.6f}, "
                 f"all float {self.all_float:.6f}",
                 f"{'rank':>4}  {'layer':<{width}}  {'type':<16} {'only this quantized':>20} {'drop':>10} "
                 f"{'only this float':>16} {'gain':>10}"]
        for k, r in enumerate(self.ranked, 1):
            lines.append(f"{k:>4}  {r['layer']:<{width}}  {r['type'][:16]:<16} {r['only_quantized']:>20.6f} "
                         f"{r['drop']:>10.3e} {r['only_float']:>16.6f} {r['gain']:>10.3e}")
        return "\n".join(lines)


def sensitivity(model: nn.Module, data: Optional[Iterable] = None, metric: Metric = "cosine",
                num_batches: Optional[int] = 8, *, layers: Optional[Sequence[str]] = None,
                input_fn: Optional[Callable] = None, progress: bool = True) -> SensitivityReport:
    """Rank the quantized layers of a calibrated QAT ``model`` (see the module docstring).

    Args:
        metric: "cosine" (outputs vs float, on ``num_batches`` batches of ``data``) or a
            ``callable(model) -> float``, higher is better (e.g. accuracy).
        layers: restrict to these layer paths (default: every active QAT layer).

    Quantizer states and the model's mode are restored afterwards; scales are never recomputed.

    Example:
        >>> rep = dal.analysis.sensitivity(qat_model, loader, num_batches=4)   # doctest: +SKIP
        >>> rep.ranked[0]["layer"]                                             # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    chosen = active_layers(model)
    if layers is not None:
        unknown = sorted(set(layers) - {n for n, _ in chosen})
        if unknown:
            raise ValueError(f"sensitivity: {unknown} are not active QAT layers of the model; "
                             f"known: {[n for n, _ in chosen]}")
        chosen = [(n, m) for n, m in chosen if n in set(layers)]
    all_q = [q for _, q in quantizers(model)]
    with evaluating(model):
        ev = Evaluator(model, data, metric, num_batches, input_fn, progress, "dal.analysis.sensitivity")
        states = {q: q.state for q in all_q}

        def restore():
            for q, s in states.items():
                switch([q], s)

        on = ev()
        switch(all_q, "off")
        off = ev()
        restore()
        rows = []
        for name, mod in tqdm(chosen, desc="dal.analysis.sensitivity", disable=not progress, leave=False):
            own = layer_quantizers(mod)
            switch(all_q, "off")
            for q in own:
                switch([q], states[q])
            only_q = ev()
            restore()
            switch(own, "off")
            only_f = ev()
            restore()
            rows.append({"layer": name, "type": type(mod).__name__, "only_quantized": only_q, "drop": off - only_q,
                         "only_float": only_f, "gain": only_f - on})
    return SensitivityReport(ev.name, on, off, rows)
