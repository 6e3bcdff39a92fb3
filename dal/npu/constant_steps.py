"""Constant folding at load: steps whose every input is a constant run once, not per run.

A plain node step (NodeStep, or its DequantStep / QuantStep fast path) whose named inputs are
all constants (initializers, Constant nodes, or outputs of steps folded before it) computes the
same value on every run, e.g. the DequantizeLinear of a weight. ``fold`` runs each such live,
deterministic step once, in step order, and returns (kept steps, folded values); the session
seeds every run's tensor environment with the folded values, so later steps read them as they
read any tensor. Integer groups and table/pool groups are never folded: they were matched on the
graph before folding and keep their exact integer arithmetic. A step that fails on its constants
is not folded: it stays a step and raises its named NPUError at run time, as without folding.
"""
from __future__ import annotations

from .errors import NPUError

# ops whose output is not a function of their inputs: never computed ahead of a run
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                              "RandomUniformLike", "Bernoulli", "Multinomial"})


def foldable(step) -> bool:
    """Whether ``step`` is a plain node step of a deterministic op (see the module docstring)."""
    from .quant_step import DequantStep, QuantStep
    from .session import NodeStep
    return (isinstance(step, (NodeStep, DequantStep, QuantStep))
            and step.node.op_type not in NONDETERMINISTIC and step.node.domain in ("", "ai.onnx"))


def fold(steps, live, consts, execute):
    """(steps left to run, {tensor name: value}) after running every live foldable step whose
    named inputs are all in ``consts`` or folded earlier, via ``execute(step, ins)`` (the
    session's run-time call, so a value is bit-identical to what the run would compute).
    Dead steps are left as they are (a run never computes them)."""
    kept, folded = [], {}
    for step, is_live in zip(steps, live):
        names = [i for i in step.inputs if i]
        if is_live and names and foldable(step) and all(i in consts or i in folded for i in names):
            ins = [None if not i else folded[i] if i in folded else consts[i] for i in step.inputs]
            try:
                out = execute(step, ins)
            except NPUError:  # left to the run, which raises it with the same name and message
                kept.append(step)
                continue
            folded.update(out)
            continue
        kept.append(step)
    return kept, folded
