"""Shared-scale groups: ops the hardware runs without requantizing (``shared_scale: [cat, ...]``
in the hardware model) get one quantizer for all their inputs and their output.

Found from prepare's plan: every functional QAT op (``QCat``, ``QAdd``, ...) whose op class the
hardware lists in ``shared_scale``. Its input quantizers and its output quantizer become one
``FakeQuantizer`` (the first input's, built from the recipe's spec; an output quantizer is
added when the recipe gave none, so the exported output carries the group's scale too). Its
observer is wrapped in ``dal.observers.union.UnionObserver``, so calibration and QAT see the
union of the group's tensors per forward: for a concat, exactly the union of the input
ranges. In the exported file every input and the output of such an op then has one scale and
one zero point, and on integer codes the op is a plain concat (codes copied, no rounding).
"""
from __future__ import annotations

from torch import nn

from ..observers.union import UnionObserver


def _flush_before(module, args) -> None:
    obs = getattr(module.output_quant, "observer", None)
    if isinstance(obs, UnionObserver):
        obs.flush()


def _flush_after_observing(module, args, out) -> None:
    q = module.output_quant
    if isinstance(getattr(q, "observer", None), UnionObserver) and q.state == "observe":
        q.observer.flush()


def share_scales(model: nn.Module, op_classes, report=None) -> list[str]:
    """Make every functional QAT op of ``model`` whose ``op_class`` is in ``op_classes`` one
    shared-scale group; returns their paths (also noted in ``report`` when given).

    A group's members are ``input_quants[i]`` and ``output_quant``; afterwards they are the
    same module object, so ``scale``, ``zero_point`` and the state are one for all of them.
    """
    grouped = []
    wanted = set(op_classes or ())
    for path, mod in model.named_modules():
        if getattr(mod, "op_class", None) not in wanted or not isinstance(getattr(mod, "input_quants", None),
                                                                           nn.ModuleList):
            continue
        members = list(mod.input_quants) + ([mod.output_quant] if mod.output_quant is not None else [])
        scaled = [q for q in members if q is not None and q.fmt.is_scaled]
        if not scaled:
            continue
        shared = scaled[0]
        if any((q.fmt, q.symmetric, q.narrow_range) != (shared.fmt, shared.symmetric, shared.narrow_range)
               for q in scaled):
            raise ValueError(f"{path} ({type(mod).__name__}): the hardware runs {mod.op_class} without "
                             f"requantizing, so its inputs and output share one scale, but the recipe gives "
                             f"them different formats ({', '.join(sorted({q.fmt.name for q in scaled}))}) or "
                             "symmetry; give them one tensor spec")
        if not isinstance(shared.observer, UnionObserver) and shared.observer is not None:
            shared.observer = UnionObserver(shared.observer)
        shared.name = f"{path}.shared_quant"
        for i in range(len(mod.input_quants)):
            mod.input_quants[i] = shared
        mod.output_quant = shared
        mod.register_forward_pre_hook(_flush_before)
        mod.register_forward_hook(_flush_after_observing)
        grouped.append(path)
    if report is not None and grouped:
        report.notes.append(f"shared-scale groups (one scale and zero point for inputs and output, the "
                            f"hardware does not requantize them): {', '.join(grouped)}")
    return grouped
