"""Latency from the hardware model's cost section, and mixed precision searched under a budget.

    est = dal.estimate(qat_model, "a2000", example_inputs=(x,))     # per layer + total + per engine
    res = dal.search_precision(float_model, calib, "a2000", latency_budget="0.8x",
                               example_inputs=(x,))                 # a recipe under the budget
    res.recipe.to_yaml("searched.yaml"); print(res.pareto_table())

``roofline`` times one layer; ``torch_graph`` / ``onnx_graph`` find the layers of a model or an
exported file; ``estimator`` adds them up; ``scores`` measures each layer's sensitivity to each
candidate format; ``solve`` picks one candidate per layer group exactly (a Pareto dynamic
programme); ``search`` ties it together and writes the recipe.
"""
from __future__ import annotations

import importlib

_NAMES = {
    "estimate": "estimator", "estimate_layers": "estimator", "Estimate": "estimator",
    "LayerCost": "roofline", "LayerGeom": "roofline", "Choice": "roofline", "layer_cost": "roofline",
    "search_precision": "search", "SearchResult": "search",
    "MissingCostError": "estimator",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"dal.cost.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'dal.cost' has no attribute {name!r}")
