"""``dal.search_precision``: per-layer formats chosen under a latency or size budget, exactly.

1. The float model is prepared (a copy) with ``base_recipe`` and traced once
   (``dal.cost.torch_graph``): every layer's geometry and its base formats.
2. Searched layers are the conv / linear layers with a weight quantizer. Each gets the
   candidates the hardware allows: ``int4`` (int4 weights, the base recipe's input format),
   ``int8``, ``int16`` (int16 weights and inputs; ``w8a16``, int16 inputs with the base 8-bit
   weights, where the hardware has only a 16-bit activation mode), ``fp16`` (``fallback: fp16``), each dense
   and, where the hardware runs 2:4 for the op class and the weight fits the pattern, ``2:4``.
3. Each candidate is timed by the roofline (``dal.cost.roofline``) and scored for sensitivity
   (``dal.cost.scores``: ``method="fisher"`` or ``"output_error"``; their costs are there).
4. Layers that read the same tensor must store it in one format, so they form one group and take
   the same candidate; so do the layers whose outputs feed one op the hardware runs without
   requantizing (its ``shared_scale`` op classes, e.g. the branches of a ``torch.cat``:
   ``dal.cost.shared_groups``); ``groups=`` adds the user's own. The
   solver (``dal.cost.solve``) picks one candidate per group, exactly, minimising the summed
   score with ``fixed + sum(latency) <= latency_budget`` and ``sum(weight bytes) <= size_budget``.
5. The result's ``recipe`` is ``base_recipe`` with one rule per searched layer prepended
   (``Recipe.with_rules_prepended``): ``recipe.to_yaml(path)`` writes the file to commit, and
   ``dal.prepare_qat(model, recipe)`` builds it. ``pareto`` is the solver's front.

Budgets: a number of milliseconds (latency) / bytes (size), or ``"0.8x"``: that fraction of
the same model with every searched layer in dense INT8 (the layers not searched are included).
A budget nothing meets raises ``ValueError`` with the smallest achievable figure; a hardware
model without ``cost:`` raises ``MissingCostError`` before any work.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch import nn

from ..formats import FP16, get_format
from ..hardware import load_hardware
from ..config.problems import Problem
from ..hardware.cost import MissingCostError, require_cost
from .estimator import estimate_layers
from .roofline import Choice, layer_cost, weight_bytes
from .shared_groups import shared_scale_groups
from .solve import Option, solve

SEARCHED = ("conv", "linear")


@dataclass(frozen=True)
class Candidate:
    """``key`` such as ``int4``, ``int8+2:4``, ``fp16``; the recipe ``rule`` it becomes."""

    key: str
    weight: object
    input: object
    sparse: bool
    rule: dict


@dataclass
class SearchResult:
    """What ``search_precision`` chose: ``choice`` (layer -> candidate key), the ``recipe``,
    estimated ``latency_ms`` and weight ``size_bytes``, the summed ``score``, the budgets, the
    uniform-INT8 reference figures and the Pareto ``front`` [(ms, bytes, score, {layer: key})]."""

    choice: dict
    recipe: object
    latency_ms: float
    size_bytes: float
    score: float
    latency_budget_ms: Optional[float]
    size_budget_bytes: Optional[float]
    int8_latency_ms: float
    int8_size_bytes: float
    method: str
    groups: list = field(default_factory=list)
    scores: dict = field(default_factory=dict, repr=False)
    front: list = field(default_factory=list, repr=False)
    rules: dict = field(default_factory=dict, repr=False)      # layer -> {candidate key: recipe rule}
    base_recipe: object = field(default=None, repr=False)      # the recipe the rules are prepended to
    measured: dict = field(default_factory=dict)               # front index -> measured metric

    def recipe_for(self, picks: dict):
        """The recipe of any front point's ``{layer: key}`` (the chosen one is ``self.recipe``)."""
        return self.base_recipe.with_rules_prepended([self.rules[n][k] for n, k in picks.items()])

    def spread(self, points: int) -> list:
        """Indices of up to ``points`` front points spread evenly over latency, cheapest first: the
        points ``pareto_table(points)`` shows and ``measure(points=points)`` measures. A caller
        measuring them its own way (e.g. with QAT) stores ``measured[i] = value`` for these."""
        order = sorted(range(len(self.front)), key=lambda i: self.front[i][0])
        if len(order) > points > 1:
            order = [order[round(i * (len(order) - 1) / (points - 1))] for i in range(points)]
        return order[:max(points, 1)]

    def measure(self, model, calib_data, evaluate, hardware, example_inputs, points: int = 6,
                num_batches: int = 8) -> dict:
        """Measure ``evaluate(model) -> float`` (e.g. accuracy) on up to ``points`` front points
        spread over latency: each is prepared from a copy of the float ``model``, calibrated on
        ``num_batches`` of ``calib_data`` (PTQ, no training) and evaluated. Fills ``measured``
        (front index -> value), which ``pareto_table`` and the HTML report show."""
        from ..calibration import calibrate
        from ..prepare import prepare_qat

        ex = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
        for i in self.spread(points):
            q = prepare_qat(copy.deepcopy(model), recipe=self.recipe_for(self.front[i][3]), hardware=hardware,
                            example_inputs=ex)
            calibrate(q, calib_data, num_batches, progress=False)
            self.measured[i] = float(evaluate(q))
        return self.measured

    def pareto_table(self, rows: int = 12) -> str:
        """Up to ``rows`` points of the front spread over latency, as a markdown table."""
        idx = (sorted(self.measured, key=lambda i: self.front[i][0]) if self.measured else self.spread(rows))
        lines = ["| latency (ms) | x INT8 | weights (bytes) | predicted score | measured | formats |",
                 "|---|---|---|---|---|---|"]
        for i in idx:
            ms, size, score, picks = self.front[i]
            got = f"{self.measured[i]:.4g}" if i in self.measured else "-"
            counts: dict = {}
            for k in picks.values():
                counts[k] = counts.get(k, 0) + 1
            mix = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            lines.append(f"| {ms:.4f} | {ms / self.int8_latency_ms:.3f} | {size:,.0f} | {score:.4g} | {got} | {mix} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        width = max([len(n) for n in self.choice] + [5])
        lines = [f"dal.search_precision ({self.method}): {self.latency_ms:.4f} ms "
                 f"({self.latency_ms / self.int8_latency_ms:.3f}x uniform INT8), {self.size_bytes:,.0f} weight bytes, "
                 f"score {self.score:.4g}"]
        lines += [f"  {n:<{width}}  {k}" for n, k in self.choice.items()]
        return "\n".join(lines)


def _rule(name, key, wfmt, in_spec, sparse) -> dict:
    if wfmt == FP16:
        rule = {"match": name, "fallback": "fp16"}
    else:
        rule = {"match": name, "weight": {"format": wfmt.name, "granularity": "per_channel", "symmetric": True,
                                          "observer": "minmax"}, "input": in_spec}
    if sparse:
        rule["sparsity"] = "2:4"
    return rule


def _input_spec(spec, fmt) -> dict:
    """The base recipe's input spec (as YAML), or a per-tensor affine one for another format."""
    base = getattr(spec, "input", None)
    if base is not None and base.format == fmt:
        d = {"format": fmt.name, "granularity": base.granularity, "symmetric": base.symmetric,
             "observer": base.observer}
        if base.observer_args:
            d["observer_args"] = dict(base.observer_args)
        return d
    return {"format": fmt.name, "granularity": "per_tensor", "symmetric": False, "observer": "moving_average"}


def candidates_for(geom, mod, spec, base: Choice, hw, formats: Sequence[str], sparsity: Sequence[str]) -> list:
    """The candidates of one layer the hardware allows (module docstring, step 2)."""
    allowed_w, allowed_x = hw.allowed_formats(geom.op_class, "weight"), hw.allowed_formats(geom.op_class, "input")
    fits_24 = (getattr(mod, "groups", 1) == 1 and (mod.weight.numel() // mod.weight.shape[0]) % 4 == 0
               and mod.weight.shape[1] % 4 == 0)
    out = []
    for name in formats:
        w = get_format(name)
        x = base.input if w.bits <= 8 and w.is_integer else w
        wide = w.name == "int16" and w not in allowed_w and base.weight in allowed_w
        if wide:  # a 16-bit activation mode with 8-bit weights (A16W8): int16 inputs, the base weights
            w = base.weight
        if w not in allowed_w or x not in allowed_x:
            continue
        for mode in sparsity:
            sparse = mode == "2:4"
            if sparse and not (fits_24 and hw.supports_sparsity(geom.op_class, "2:4")):
                continue
            key = ("w8a16" if wide else w.name) + ("+2:4" if sparse else "")
            out.append(Candidate(key, w, x, sparse, _rule(geom.name, key, w, _input_spec(spec, x), sparse)))
    return out


def _groups(layers, names, user_groups):
    """Union of: layers reading the same tensor (found by the trace), and ``user_groups``."""
    parent = {n: n for n in names}

    def find(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for group in list(user_groups or []) + list(layers):
        members = [n for n in group if n in parent]
        for a in members[1:]:
            parent[find(a)] = find(members[0])
    out: dict = {}
    for n in names:
        out.setdefault(find(n), []).append(n)
    return list(out.values())


def _budget(value, reference: float, what: str) -> float:
    if value is None:
        return math.inf
    if isinstance(value, str) and value.endswith("x"):
        try:
            return float(value[:-1]) * reference
        except ValueError:
            pass
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise ValueError(f"search_precision: {what}={value!r}: give a positive number or a fraction of uniform "
                     "INT8 such as '0.8x'")


def _shared_inputs(model, example_inputs, names) -> list:
    """Groups of searched layers whose forward reads the very same input tensor (the same value
    in one ``dal.capture`` record of a forward)."""
    import torch

    from ..capture import capture

    wanted = set(names)
    with torch.no_grad():
        record = capture(model, *example_inputs, functions=False, sites=False)
    seen: dict = {}
    for c in record.modules():
        if c.path in wanted and c.ins:
            seen.setdefault(c.ins[0], [])
            if c.path not in seen[c.ins[0]]:
                seen[c.ins[0]].append(c.path)
    return [g for g in seen.values() if len(g) > 1]


def _setup(model, hw, base_recipe, example_inputs):
    """The base prepared copy's traced layers, base choices and plan specs."""
    from ..prepare import prepare_qat, prepared
    from .choices import prepared_choices
    from .torch_graph import trace_layers

    base = prepare_qat(copy.deepcopy(model), recipe=base_recipe, hardware=hw, example_inputs=example_inputs)
    layers = trace_layers(base, example_inputs)
    choices = prepared_choices(layers, base, hw)
    specs = {s.path: s.spec for s in prepared(base).plan}
    return base, layers, choices, specs, prepared(base).recipe


def _options(layers, choices, specs, hw, model, formats, sparsity):
    """searched name -> (geom, engine, {key: Candidate}), and the fixed latency of the others."""
    searched, fixed = {}, 0.0
    modules = dict(model.named_modules())
    for geom, qmod in layers:
        base = choices[geom.name]
        name = geom.name
        if (geom.op_class in SEARCHED and base is not None and base.weight is not None and "#" not in name
                and name in modules and hasattr(modules[name], "weight")):
            cands = candidates_for(geom, modules[name], specs.get(name), base, hw, formats, sparsity)
            if cands:
                searched[name] = (geom, hw.op(geom.op_class).engine, {c.key: c for c in cands}, base)
                continue
        if base is not None and hw.op(geom.op_class) is not None:
            fixed += layer_cost(geom, base, hw.op(geom.op_class).engine, hw).cycles
    return searched, fixed


def _cost(geom, engine, cand: Candidate, base: Choice, hw):
    # prepare gives an output quantizer only to the layers producing the model's outputs, in the
    # rule's input format; others requantize to the format they read in (dal.cost.choices)
    narrow = cand.input.bits <= 8 and cand.weight.bits <= 8 and cand.weight.is_integer
    out = base.output if narrow and base.output.bits <= 8 else cand.input
    choice = Choice(cand.weight, cand.input, out, sparse=cand.sparse)
    return layer_cost(geom, choice, engine, hw).cycles, weight_bytes(geom, choice), choice


def search_precision(model: nn.Module, calib_data, hardware, latency_budget=None, size_budget=None,
                     candidates: Sequence[str] = ("int4", "int8", "int16", "fp16"),
                     sparsity: Sequence[str] = ("dense", "2:4"), *, method: str = "fisher", example_inputs=None,
                     base_recipe="int8_balanced", num_batches: int = 4, loss_fn=None,
                     groups: Optional[Sequence[Sequence[str]]] = None) -> SearchResult:
    """Choose a format per layer of the float ``model`` under a budget (see the module docstring).

    Args:
        calib_data: batches (tensors or (input, target) pairs); the first ``num_batches`` score.
        hardware: a hardware model with a ``cost:`` section.
        latency_budget / size_budget: ms / weight bytes, or ``"0.8x"`` of uniform INT8.
        candidates, sparsity: the formats and sparsity modes tried (those the hardware lacks are
            skipped); ``method``: ``"fisher"`` or ``"output_error"``.
        example_inputs: traced for shapes; their batch size is the batch timed (default: the
            first calibration batch's inputs).
        base_recipe: the recipe every layer not searched keeps, and the searched layers' inputs.
        groups: lists of layer paths that must take one candidate (added to the automatic ones).

    >>> res = dal.search_precision(net, calib, "a2000", latency_budget="0.8x")   # doctest: +SKIP
    >>> res.recipe.to_yaml("searched.yaml"); print(res.pareto_table())          # doctest: +SKIP
    """
    from .scores import fisher_scores, output_error_scores

    hw = load_hardware(hardware)
    cost = require_cost(hw)
    if method not in ("fisher", "output_error"):
        raise ValueError(f"search_precision: method={method!r}: use 'fisher' or 'output_error'")
    batches = [b for _, b in zip(range(num_batches), calib_data)]
    if not batches:
        raise ValueError("search_precision: calib_data gave no batch")
    if example_inputs is None:
        first = batches[0]
        example_inputs = (first[0] if isinstance(first, (list, tuple)) else first,)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (example_inputs,)
    base, layers, choices, specs, recipe = _setup(model, hw, base_recipe, example_inputs)
    estimate_layers([g for g, _ in layers], choices, hw)  # every cost key the base needs, named at once
    searched, fixed = _options(layers, choices, specs, hw, model, candidates, sparsity)
    if not searched:
        raise ValueError("search_precision: no conv or linear layer with a weight quantizer to search")
    table = {n: {k: _cost(g, e, c, b, hw) for k, c in cands.items()} for n, (g, e, cands, b) in searched.items()}
    missing = cost.missing([t for n, (g, e, cands, b) in searched.items() for c in cands.values()
                            for t in _needs(g, e, c)])
    if missing:
        raise MissingCostError([Problem(f"missing cost key {m}; add it or drop that candidate", ("cost",),
                                        hw.source or "<dict>") for m in missing])
    fmts = {n: [(k, c.weight, c.input, c.sparse) for k, c in cands.items()] for n, (_, _, cands, _) in searched.items()}
    float_model = copy.deepcopy(model)
    scores = (fisher_scores(float_model, batches, fmts, loss_fn) if method == "fisher"
              else output_error_scores(float_model, batches, fmts))
    auto = _shared_inputs(float_model, example_inputs, list(searched))
    auto += shared_scale_groups(base, example_inputs, list(searched), hw.shared_scale)
    grouped = _groups(auto, list(searched), groups)
    return _solve(grouped, searched, table, scores, fixed, cost, latency_budget, size_budget, recipe, method)


def _needs(geom, engine, cand):
    from .roofline import needs

    return needs(geom, Choice(cand.weight, cand.input, sparse=cand.sparse), engine)


def _group_options(grouped, searched, table, scores):
    out = []
    for group in grouped:
        keys = [k for k in searched[group[0]][2] if all(k in searched[n][2] for n in group)]
        if not keys:
            raise ValueError(f"search_precision: layers {group} must share a format but have no candidate in common")
        out.append([Option(k, sum(table[n][k][0] for n in group), sum(table[n][k][1] for n in group),
                           sum(scores[n][k] for n in group)) for k in keys])
    return out


def _solve(grouped, searched, table, scores, fixed, cost, latency_budget, size_budget, recipe, method):
    opts = _group_options(grouped, searched, table, scores)
    int8_lat = fixed + sum(table[n]["int8"][0] if "int8" in table[n] else min(v[0] for v in table[n].values())
                           for n in searched)
    int8_size = sum(table[n]["int8"][1] if "int8" in table[n] else 0.0 for n in searched)
    ms = cost.cycles_to_ms
    lat_b = _budget(latency_budget, ms(int8_lat), "latency_budget")
    size_b = _budget(size_budget, int8_size, "size_budget")
    lat_cycles = lat_b * cost.clock_mhz * 1000.0 if math.isfinite(lat_b) else math.inf
    best, front = solve(opts, lat_cycles, size_b, fixed, 0.0)
    if best is None:
        least_lat = fixed + sum(min(o.latency for o in g) for g in opts)
        least_size = sum(min(o.size for o in g) for g in opts)
        raise ValueError(f"search_precision: no choice of formats meets latency_budget={latency_budget!r} "
                         f"({lat_b:.6g} ms) and size_budget={size_budget!r} ({size_b:.6g} bytes); the smallest "
                         f"achievable latency is {ms(least_lat):.6g} ms ({ms(least_lat) / ms(int8_lat):.3f}x INT8) "
                         f"and the smallest weight size {least_size:,.0f} bytes")

    def named(picks):
        return {n: opts[i][p].key for i, g in enumerate(grouped) for p in [picks[i]] for n in g}

    choice = named(best[3])
    order = [n for n in searched]
    choice = {n: choice[n] for n in order}
    rules = [searched[n][2][k].rule for n, k in choice.items()]
    front_named = [(ms(lat), size, score, named(p)) for lat, size, score, p in front]
    import dataclasses

    budget = f"latency {latency_budget}" if latency_budget is not None else f"size {size_budget}"
    recipe = dataclasses.replace(recipe, name=f"{recipe.name}_searched", description=(
        f"dal.search_precision ({method}) under {budget} on top of {recipe.name}: one rule per searched layer"))
    return SearchResult(choice, recipe.with_rules_prepended(rules), ms(best[0]), best[1], best[2],
                        lat_b if math.isfinite(lat_b) else None, size_b if math.isfinite(size_b) else None,
                        ms(int8_lat), int8_size, method, grouped, scores, front_named,
                        {n: {k: c.rule for k, c in searched[n][2].items()} for n in searched}, recipe)
