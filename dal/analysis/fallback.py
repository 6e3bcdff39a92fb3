"""auto_fallback: the fewest layers to move up (INT16, else FP16) so that the model reaches a target metric.

1. Rank the quantized layers by ``gain`` (``sensitivity``: what keeping each one in float buys).
2. Greedy over the moves: each layer in that order steps INT8 -> INT16 (when the hardware model
   offers int16 for its op class: ``int16_step.int16_rule``) -> FP16 (only when the hardware
   runs that op class in fp16: ``int16_step.fp16_allowed``), one move at a time, until
   ``M(model with those moves) >= target``. FP16 is simulated in place exactly as
   ``prepare_qat`` builds a ``fallback: fp16`` layer (input and weight rounded to FP16, no
   output quantizer); INT16 by an int16 quantizer over the INT8 one's range
   (``int16_step.int16_quantizer``); every other scale stays as is.
3. Prune: drop any chosen layer whose removal still meets the target (latest first).
4. The result's ``recipe`` is the model's recipe with ``{match: <layer>, fallback: fp16}`` (or the
   INT16 rule) rules prepended (``Recipe.with_rules_prepended``): ``recipe.to_yaml(path)`` saves it, and
   ``prepare_qat(float_model, recipe)`` rebuilds the model with those layers in FP16, which the
   exporter writes as ``Cast(to=float16)`` regions.
5. Verify (when ``float_model`` is given): re-prepare a copy of it with the new recipe,
   calibrate it on ``data`` and measure again; while the target is missed, the next-ranked
   layer is added and the check repeated; then the pruning of step 3 is repeated on
   re-prepared models (re-calibration after an FP16 layer moves the metric by a hair).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

from torch import nn

from ..nn.tree import has_instance_attribute, own_slots, remove_child, set_child
from ..prepare.handle import find_prepared, prepared
from .common import evaluating, qat_layers
from .evaluator import Evaluator, Metric
from .int16_step import int16_quantizer, int16_rule, precision_steps
from .sensitivity import sensitivity


@dataclass
class FallbackResult:
    """``layers``: names moved up, ``formats`` (name -> "int16" or "fp16") what to; ``metric``:
    the value reached (verified when ``verified_metric`` is not None); ``met``: whether
    ``target`` was reached; ``recipe``: the recipe to save and re-prepare with; ``model``: the
    re-prepared, calibrated model (verify step) or None; ``history``: (layers, metric) of every
    evaluation; ``int16_rules``: the INT16 rule of each layer that had that step."""

    layers: list
    metric: float
    target: float
    met: bool
    recipe: object
    baseline: float = 0.0
    verified_metric: Optional[float] = None
    model: Optional[nn.Module] = None
    history: list = field(default_factory=list)
    sensitivity: object = None
    formats: dict = field(default_factory=dict)
    int16_rules: dict = field(default_factory=dict, repr=False)

    def rules(self) -> list:
        return _rules(self.formats, self.int16_rules, self.layers)

    def __str__(self) -> str:
        state = "met" if self.met else "NOT met"
        verified = f", verified after re-prepare: {self.verified_metric:.6f}" if self.verified_metric is not None else ""
        moved = [f"{n}:{self.formats.get(n, 'fp16')}" for n in self.layers]
        return (f"dal.analysis.auto_fallback: target {self.target:.6f} {state} with {len(self.layers)} layer(s) moved "
                f"{moved}: {self.metric:.6f} (all quantized: {self.baseline:.6f}{verified})")


#: marks an ``output_quant = None`` that was a plain attribute (not in ``_modules``) before the simulation
_PLAIN_NONE = object()


def _fp16_quantizer(name: str):
    from ..quantizer import FakeQuantizer

    return FakeQuantizer("fp16", name=name).set_state("quantize")


@contextlib.contextmanager
def precision_fallback(model: nn.Module, formats: dict) -> Iterator[None]:
    """Temporarily move the named QAT layers to ``formats[name]``: "fp16" as ``fp16_fallback``,
    "int16": input (and output) quantizers replaced by ``int16_quantizer`` over their range."""
    mods = dict(qat_layers(model))
    saved = []
    try:
        for name in [n for n, f in formats.items() if f == "int16"]:
            for attr in ("input_quant", "output_quant"):
                old = own_slots(mods[name]).modules.get(attr)
                if old is not None:
                    saved.append((mods[name], attr, old))
                    set_child(mods[name], attr, int16_quantizer(old, f"{name}.{attr}"))
        with fp16_fallback(model, [n for n, f in formats.items() if f == "fp16"]):
            yield
    finally:
        for mod, attr, old in reversed(saved):
            set_child(mod, attr, old)


@contextlib.contextmanager
def fp16_fallback(model: nn.Module, names) -> Iterator[None]:
    """Temporarily give the named QAT layers the quantizers of a ``fallback: fp16`` spec, as
    ``dal.nn.spec.role_specs`` builds them: input, weight and output FP16 casts (functional ops:
    FP16 inputs and output). The output cast is added where the layer had no output quantizer:
    the chip writes the FP16 result, which the next int8 quantizer reads (export/SPEC.md §6)."""
    from torch.nn import ModuleList

    mods = dict(qat_layers(model))
    saved = []
    try:
        for name in names:
            mod = mods[name]
            for attr in ("input_quant", "weight_quant", "output_quant", "input_quants"):
                if attr == "output_quant" and has_instance_attribute(mod, "output_quant"):
                    # a plain ``self.output_quant = None`` attribute: register the FP16 cast as a module
                    saved.append((mod, attr, _PLAIN_NONE))
                    setattr(mod, attr, _fp16_quantizer(f"{name}.{attr}"))
                    continue
                slots = own_slots(mod).modules
                if attr not in slots:
                    continue
                old = slots[attr]
                saved.append((mod, attr, old))
                if old is None and attr != "output_quant":
                    continue
                if attr == "input_quants":
                    new = ModuleList([_fp16_quantizer(f"{name}.input_quants.{i}") for i in range(len(old))])
                else:
                    new = _fp16_quantizer(f"{name}.{attr}")
                set_child(mod, attr, new)
        yield
    finally:
        for mod, attr, old in reversed(saved):
            if old is _PLAIN_NONE:
                remove_child(mod, attr)
                object.__setattr__(mod, attr, None)
            else:
                set_child(mod, attr, old)


def auto_fallback(model: nn.Module, data: Optional[Iterable] = None, target: float = 0.99, metric: Metric = "cosine",
                  *, float_model: Optional[nn.Module] = None, example_inputs=None, num_batches: Optional[int] = 8,
                  calibrate_args: Optional[dict] = None, max_layers: Optional[int] = None,
                  input_fn: Optional[Callable] = None, progress: bool = True) -> FallbackResult:
    """Choose FP16 fallback layers for a calibrated QAT ``model`` (see the module docstring).

    Args:
        target: the metric value to reach (cosine of outputs vs float by default, or whatever
            the ``metric`` callable returns, e.g. accuracy in percent).
        float_model: the float model ``model`` was prepared from; given, the choice is verified
            by re-preparing a copy of it and calibrating on ``data`` (``num_batches`` batches,
            ``calibrate_args`` passed to ``dal.calibrate``, e.g. ``{"method": "mse"}``).
        example_inputs: for the re-prepare (default: the first batch of ``data``).

    Example:
        >>> res = dal.analysis.auto_fallback(qat, loader, target=0.995, float_model=net)  # doctest: +SKIP
        >>> res.recipe.to_yaml("my_recipe.yaml"); res.layers                               # doctest: +SKIP
    """
    handle = find_prepared(model)
    recipe = handle.recipe if handle is not None else None
    if recipe is None:
        raise ValueError("auto_fallback: the model was not prepared with dal.prepare_qat (no recipe attached)")
    if float_model is not None and (float_model is model or find_prepared(float_model) is not None):
        raise ValueError("auto_fallback: float_model is a prepared model (prepare_qat works in place by default, "
                         "so the model it returned is the one you passed); keep a float copy: "
                         "prepare_qat(copy.deepcopy(net), ...) or prepare_qat(net, ..., inplace=False)")
    sens = sensitivity(model, data, metric, num_batches, input_fn=input_fn, progress=progress)
    order = [r["layer"] for r in sens.ranked_by_gain]
    limit = len(order) if max_layers is None else min(max_layers, len(order))
    int16 = {n: r for n in order[:limit] if (r := int16_rule(model, n)) is not None}
    moves = [(n, f) for n in order[:limit] for f in precision_steps(model, n, int16.get(n))]
    history = []
    with evaluating(model):
        ev = Evaluator(model, data, metric, num_batches, input_fn, False, "dal.analysis.auto_fallback")

        def measure(formats):
            with precision_fallback(model, formats):
                value = ev()
            history.append((list(formats), value))
            return value

        chosen: dict = {}
        value = baseline = measure(chosen)
        done = 0
        while value < target and done < len(moves):
            chosen = dict(chosen, **dict([moves[done]]))
            done += 1
            value = measure(chosen)
        if value >= target:
            for name in list(reversed(list(chosen)[:-1])):
                trial = {n: f for n, f in chosen.items() if n != name}
                v = measure(trial)
                if v >= target:
                    chosen, value = trial, v
    result = FallbackResult(list(chosen), value, target, value >= target, _recipe_with(recipe, chosen, int16),
                            baseline, history=history, sensitivity=sens, formats=chosen, int16_rules=int16)
    if float_model is not None:
        _verify(result, model, float_model, data, metric, moves, example_inputs, num_batches,
                calibrate_args or {}, input_fn)
    return result


def _rules(formats: dict, int16: dict, names=None) -> list:
    return [int16[n] if formats.get(n) == "int16" else {"match": n, "fallback": "fp16"}
            for n in (formats if names is None else names)]


def _recipe_with(recipe, formats: dict, int16: dict):
    return recipe.with_rules_prepended(_rules(formats, int16)) if formats else recipe


def _verify(result, model, float_model, data, metric, moves, example_inputs, num_batches, calibrate_args,
            input_fn) -> None:
    from ..calibration import calibrate
    from ..calibration.batches import cached_inputs
    from ..prepare import prepare_qat

    if data is None:
        raise ValueError("auto_fallback: verifying with float_model needs calibration data")
    if example_inputs is None:
        args, _ = cached_inputs(data, 1, input_fn=input_fn)[0]
        example_inputs = args
    hardware = prepared(model).hardware
    ex = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)

    def real(formats):
        recipe = _recipe_with(prepared(model).recipe, formats, result.int16_rules)
        fresh = prepare_qat(copy.deepcopy(float_model), recipe=recipe, hardware=hardware, example_inputs=ex)
        calibrate(fresh, data, num_batches, input_fn=input_fn, progress=False, **calibrate_args)
        with evaluating(fresh):
            value = Evaluator(fresh, data, metric, num_batches, input_fn)()
        result.history.append((list(formats), value))
        return value, recipe, fresh

    names = dict(result.formats)
    value, recipe, fresh = real(names)
    # the next moves: past the last one whose effect the chosen formats already contain
    pending = [m for m in moves if not (names.get(m[0]) == m[1] or (m[1] == "int16" and names.get(m[0]) == "fp16"))]
    while value < result.target and pending:
        names = dict(names, **dict([pending.pop(0)]))
        value, recipe, fresh = real(names)
    if value >= result.target:
        # Re-preparing recalibrates the layers after a fallback one, so the simulated pruning
        # can be off by a hair: prune again on re-prepared models (latest added first).
        for name in list(reversed(list(names)[:-1])):
            trial = {n: f for n, f in names.items() if n != name}
            v, r, f = real(trial)
            if v >= result.target:
                names, value, recipe, fresh = trial, v, r, f
    result.layers, result.formats, result.recipe, result.model = list(names), names, recipe, fresh
    result.verified_metric = result.metric = value
    result.met = value >= result.target
