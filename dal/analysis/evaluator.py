"""The end-to-end metric the sensitivity and fallback searches maximise.

``metric="cosine"``: cosine similarity of the model's outputs (all output tensors of the cached
batches, concatenated) with the same model's outputs with every quantizer off, i.e. the float
function: ``cos(f_q(X), f(X))``. Or any ``callable(model) -> float`` where higher is better
(for example top-1 accuracy on a held-out loader); then ``data`` may be None.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

from torch import nn

from ..calibration.batches import cached_inputs, run_model
from ..prepare.state import quantizers
from .common import flat_outputs, switch
from .metrics import ErrorStats

Metric = Union[str, Callable[[nn.Module], float]]


class Evaluator:
    """``evaluator()`` -> the metric for the model's current quantizer states. Build it inside
    ``evaluating(model)`` (eval mode, no grad): the float reference is computed once, here."""

    def __init__(self, model: nn.Module, data: Optional[Iterable], metric: Metric = "cosine",
                 num_batches: Optional[int] = 8, input_fn=None, progress: bool = False, desc: str = "dal.analysis"):
        self.model = model
        self.calls = 0
        if callable(metric):
            self.fn, self.name = metric, getattr(metric, "__name__", "metric")
            return
        if metric != "cosine":
            raise ValueError(f"metric={metric!r}: use 'cosine' (outputs vs float) or a callable(model) -> float")
        if data is None:
            raise ValueError("metric='cosine' needs data (a DataLoader or a list of batches) to run the model on")
        self.fn, self.name = None, "cosine"
        self.inputs = cached_inputs(data, num_batches, input_fn=input_fn, progress=progress, desc=desc)
        all_q = [q for _, q in quantizers(model)]
        states = {q: q.state for q in all_q}
        switch(all_q, "off")
        try:
            self.refs = [[t.detach() for t in flat_outputs(run_model(model, a, k, i))]
                         for i, (a, k) in enumerate(self.inputs)]
        finally:
            for q, s in states.items():
                switch([q], s)
        if not any(self.refs):
            raise ValueError("metric='cosine': the model returned no tensor to compare")

    def __call__(self) -> float:
        self.calls += 1
        if self.fn is not None:
            return float(self.fn(self.model))
        stats = ErrorStats()
        for i, ((args, kwargs), refs) in enumerate(zip(self.inputs, self.refs)):
            for out, ref in zip(flat_outputs(run_model(self.model, args, kwargs, i)), refs):
                stats.add(out.reshape(ref.shape), ref)
        return stats.cosine
