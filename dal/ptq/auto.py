"""dal.auto_quantize: the PTQ-first flow deployment teams run, automatic.

1. The PTQ ladder, each rung a fresh PTQ of the float model, measured with ``eval_fn``:
   min-max -> the best of percentile / KL / MSE -> EasyQuant -> equalization + AdaRound + bias
   correction (calibrated with the best method of rung 2). The first rung whose drop
   ``eval_fn(float) - eval_fn(rung)`` is ``<= max_drop`` wins.
2. Otherwise: sensitivity-driven fallback on the best rung. Layers ranked by what keeping each in
   float buys (``dal.analysis.sensitivity``, metric ``eval_fn``) move, one at a time, to the next
   precision the hardware allows (INT4 -> INT8 -> INT16 -> FP16; INT16 activations only where the
   hardware model lists int16 for the op class), at most ``max_layers`` of them, until the drop
   is met. A layer that reached INT16 without meeting it goes on to FP16 before the next layer.
3. Otherwise: a model prepared for QAT with the best configuration seen, calibrated (quantizers
   in ``quantize``, train mode): train it with your own loop (``on_miss="raise"`` raises instead,
   the result attached to the error).

The float model is never modified. Returns an ``AutoQuantResult``: the model, the recipe it
settled on (``result.recipe_yaml``, committable), and one ``Rung`` row per measurement.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
import time
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .flow import quantize_ptq
from .rungs import AutoQuantizeError, AutoQuantResult, Rung

HISTOGRAM_METHODS = ("percentile", "kl", "mse")
LEARNED_STEPS = ("equalize", "adaround", "bias_correction")


def checked_metric(eval_fn: Callable, model: nn.Module, where: str) -> float:
    """``float(eval_fn(model))``, or ``AutoQuantizeError`` naming ``where`` when it raises or
    returns something that is not a finite real number."""
    name = getattr(eval_fn, "__name__", type(eval_fn).__name__)
    try:
        value = eval_fn(model)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is reported the same way
        raise AutoQuantizeError(f"auto_quantize: eval_fn {name} raised {type(exc).__name__}: {exc} "
                                f"(evaluating {where}); the float model is unchanged") from exc
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AutoQuantizeError(f"auto_quantize: eval_fn {name} returned {type(value).__name__} {value!r} "
                                f"(evaluating {where}); it must return a number, higher is better")
    if not math.isfinite(float(value)):
        raise AutoQuantizeError(f"auto_quantize: eval_fn {name} returned {value} (evaluating {where}); "
                                "it must return a finite number")
    return float(value)


class _Ladder:
    """State of one auto_quantize run: the float model, the rungs measured, the best so far."""

    def __init__(self, model, rec, calib, eval_fn, max_drop, hardware, example_inputs, num_batches,
                 input_fn, progress, adaround_args):
        self.model, self.rec, self.calib, self.eval_fn = model, rec, calib, eval_fn
        self.max_drop, self.hardware, self.example = max_drop, hardware, example_inputs
        self.num_batches, self.input_fn, self.progress = num_batches, input_fn, progress
        self.adaround_args = adaround_args
        self.rungs: list[Rung] = []
        self.best = None  # (metric, model, recipe, method, steps)
        self.float_metric = checked_metric(eval_fn, copy.deepcopy(model).eval(), "the float model")

    def run(self, name: str, rec, method: str, steps=(), changed=()) -> Rung:
        start = time.perf_counter()
        q = quantize_ptq(self.model, rec, self.calib, hardware=self.hardware, example_inputs=self.example,
                         steps=steps, method=method, num_batches=self.num_batches, input_fn=self.input_fn,
                         adaround_args=self.adaround_args)
        metric = checked_metric(self.eval_fn, q, f"rung {name!r}")
        rung = Rung(name, metric, self.float_metric - metric, time.perf_counter() - start, list(changed),
                    method, tuple(steps))
        rung.met = rung.drop <= self.max_drop
        self.rungs.append(rung)
        if self.best is None or metric > self.best[0]:
            self.best = (metric, q, rec, method, tuple(steps))
        return rung

    def recipe_for(self, rec, method, steps):
        cal = dataclasses.replace(rec.calibration, method=method)
        return dataclasses.replace(rec, calibration=cal, ptq=tuple(steps))


def _ladder(lad: _Ladder) -> Optional[Rung]:
    """Rungs 1-4; the first that meets ``max_drop``, else None."""
    from tqdm.auto import tqdm

    bar = tqdm(total=4, desc="dal.auto_quantize", disable=not lad.progress, leave=False)
    try:
        r = lad.run("min-max", lad.rec, "minmax")
        bar.update()
        if r.met:
            return r
        hist = [lad.run(f"{m}", lad.rec, m) for m in HISTOGRAM_METHODS]
        best_hist = max(hist, key=lambda x: x.metric)
        best_method = best_hist.method if best_hist.metric >= r.metric else "minmax"
        bar.update()
        if best_hist.met:
            return best_hist
        r = lad.run("easyquant", lad.rec, "easyquant")
        bar.update()
        if r.met:
            return r
        r = lad.run("equalize+adaround+bias_correction", lad.rec, best_method, LEARNED_STEPS)
        bar.update()
        return r if r.met else None
    finally:
        bar.close()


def _next_precision_rule(model, mod, name: str):
    """The rule moving layer ``name`` of ``model`` one precision up (INT4 -> INT8 -> INT16 when
    the hardware offers int16 activations for it -> FP16 when the hardware runs the op in fp16),
    or None at the top."""
    from ..analysis.int16_step import fp16_allowed, int16_rule

    wq = getattr(mod, "weight_quant", None)
    if wq is not None and wq.fmt.is_integer and wq.fmt.bits < 8:
        rule = {"match": name, "weight": {"format": "int8", "granularity": "per_channel", "symmetric": True,
                                          "observer": "minmax"}}
        iq = getattr(mod, "input_quant", None)
        if iq is not None and iq.fmt.is_scaled:
            rule["input"] = {"format": iq.fmt.name.lower(), "granularity": "per_tensor",
                             "symmetric": bool(iq.symmetric), "observer": iq.observer_name}
        return rule, "int8"
    if wq is not None and wq.fmt.is_scaled:
        rule = int16_rule(model, name)
        if rule is not None:
            return rule, "int16"
        return ({"match": name, "fallback": "fp16"}, "fp16") if fp16_allowed(model, name) else (None, None)
    return None, None


def _fallback(lad: _Ladder, max_layers: int) -> Optional[Rung]:
    """Stage 2: promote the most sensitive layers of the best rung, one at a time."""
    from ..analysis import sensitivity
    from ..analysis.int16_step import fp16_allowed
    from ..recipe.errors import RecipeError

    _, best_q, best_rec, method, steps = lad.best
    sens = sensitivity(best_q, None, lambda m: checked_metric(lad.eval_fn, m, "the sensitivity analysis"),
                       progress=lad.progress)
    mods = dict(best_q.named_modules())
    rules, changed = [], []
    for row in sens.ranked_by_gain:
        if len(changed) >= max_layers:
            break
        rule, to = _next_precision_rule(best_q, mods[row["layer"]], row["layer"])
        kept = None  # (rule, to) of the last step of this layer the hardware took
        while rule is not None:
            try:
                rec = best_rec.with_rules_prepended(rules + [rule])
                r = lad.run(f"fallback {row['layer']} -> {to}", rec, method, steps,
                            changed + [f"{row['layer']}:{to}"])
            except RecipeError:
                break  # the hardware refuses that precision for this layer: keep its last step
            kept = (rule, to)
            if r.met:
                return r
            # INT16 was not enough: this layer's next step is FP16 (replacing its INT16 rule)
            up = to == "int16" and fp16_allowed(best_q, row["layer"])
            rule, to = ({"match": row["layer"], "fallback": "fp16"}, "fp16") if up else (None, None)
        if kept is not None:
            rules.append(kept[0])
            changed.append(f"{row['layer']}:{kept[1]}")
    return None


def auto_quantize(model: nn.Module, calib_data: Iterable, eval_fn: Callable[[nn.Module], float],
                  max_drop: float = 1.0, hardware=None, recipe="int8_balanced", *, example_inputs=None,
                  num_batches: Optional[int] = None, max_layers: int = 4, on_miss: str = "qat",
                  input_fn: Optional[Callable] = None, progress: bool = True,
                  adaround_args: Optional[dict] = None) -> AutoQuantResult:
    """Quantize float ``model`` with the least effort that keeps ``eval_fn`` within ``max_drop``
    of the float model's (the flow of the module docstring).

    Args:
        calib_data: a few hundred representative samples (batches as ``dal.calibrate`` takes).
        eval_fn: ``model -> number``, higher is better (accuracy in percent, mAP, ...).
        max_drop: the largest acceptable ``eval_fn(float) - eval_fn(quantized)``, in eval_fn's unit.
        hardware: bundled name or path (default: the recipe's); recipe: the formats to reach.
        max_layers: fallback budget (how many layers may move to a higher precision).
        on_miss: "qat" (default: return a QAT-ready model) or "raise" (``AutoQuantizeError`` with
            ``.result``, the same QAT-ready result, attached).

    Example:
        >>> res = dal.auto_quantize(net, calib, lambda m: accuracy(m, val), max_drop=0.5,
        ...                         hardware="a2000", recipe="w4a8_fp8_performance")   # doctest: +SKIP
        >>> print(res); res.recipe.to_yaml("w4a8_tuned.yaml")                          # doctest: +SKIP
    """
    from ..recipe import load_recipe

    if isinstance(max_drop, bool) or not isinstance(max_drop, numbers.Real) or not math.isfinite(max_drop) \
            or max_drop < 0:
        raise ValueError(f"auto_quantize: max_drop={max_drop!r} must be a finite number >= 0 (a drop of the "
                         "metric in eval_fn's unit; 0 asks for no loss at all)")
    if on_miss not in ("qat", "raise"):
        raise ValueError(f"auto_quantize: on_miss={on_miss!r} is not one of 'qat', 'raise'")
    if not callable(eval_fn):
        raise TypeError(f"auto_quantize: eval_fn must be a callable(model) -> number, got {type(eval_fn).__name__}")
    rec = load_recipe(recipe)
    lad = _Ladder(model, rec, calib_data, eval_fn, float(max_drop), hardware, example_inputs, num_batches,
                  input_fn, progress, adaround_args)
    won = _ladder(lad) or (_fallback(lad, max_layers) if max_layers > 0 else None)
    if won is not None:
        # A met rung beats every rung before it (they missed), so it is the best seen.
        q, rec_won, method, steps = lad.best[1:]
        return AutoQuantResult(q, lad.recipe_for(rec_won, method, steps), lad.rungs, lad.float_metric,
                               lad.max_drop, "fallback" if won.name.startswith("fallback") else "ptq", won.name)
    result = _qat_handoff(lad)
    if on_miss == "raise":
        raise AutoQuantizeError(f"auto_quantize: no rung met max_drop={max_drop} (best drop "
                                f"{min(r.drop for r in lad.rungs):.4g}); result.model is prepared for QAT",
                                result=result)
    return result


def _qat_handoff(lad: _Ladder) -> AutoQuantResult:
    """Stage 3: prepare the float model with the best rung's recipe, calibrate it with its method,
    and leave it ready to train (quantizers in ``quantize``, train mode)."""
    from ..calibration import calibrate
    from ..prepare import prepare_qat
    from .flow import run_float_steps

    start = time.perf_counter()
    metric, _, rec, method, steps = lad.best
    work = copy.deepcopy(lad.model).eval()
    float_steps = [s for s in steps if s in ("fold_bn", "equalize", "smooth_quant")]
    run_float_steps(work, float_steps, lad.calib, lad.num_batches, lad.input_fn)
    example = lad.example
    if example is None:
        from ..calibration.batches import iter_inputs

        example = next(iter(iter_inputs(lad.calib, 1, input_fn=lad.input_fn)))[0]
    q = prepare_qat(work, recipe=rec, hardware=lad.hardware, example_inputs=example)
    calibrate(q, lad.calib, lad.num_batches, input_fn=lad.input_fn, progress=False, method=method)
    q.train()
    rung = Rung("QAT hand-off (train it)", metric, lad.float_metric - metric, time.perf_counter() - start, [],
                method, tuple(float_steps))
    lad.rungs.append(rung)
    return AutoQuantResult(q, lad.recipe_for(rec, method, float_steps), lad.rungs, lad.float_metric,
                           lad.max_drop, "qat", rung.name)
