"""prepare's step for forwards torch.fx cannot trace: which owners to capture by call site
(``call_sites``), on which forward, and the notes the report gets.

For a torchvision detector the owners are those inside the NPU part (``boundary``): the FPN,
the heads, ``IntermediateLayerGetter``; they are captured on one forward of the NPU part with
a zero batch at the detector's input size, so no example input is needed. The others (the
detector's own forward, ``transform``, anchors, losses, NMS) stay float on the host and are
named in a note. For any other model the example inputs drive the forward; without them, the
untraced owners are listed with the way to capture them.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..nn.modes import eval_mode
from ..quantizer import quantizer_states
from .boundary import NPUPart, example_batch, inside, is_detector, npu_paths
from .call_sites import discover
from .functional_ops import call_form
from .deformable import deformable_roles, deformable_step
from .plan import Capture, Step, site_steps


def capture_sites(model: nn.Module, cap: Capture, resolve, example_inputs,
                  on_result=None) -> tuple[list[Step], list[str]]:
    """``(steps, notes)``: a plan step per call site of every untraced owner that runs on the
    NPU, and one note per untraced owner saying what became of its functional ops.
    ``on_result``: passed to ``call_sites.discover`` (who returned what, ``example_run``)."""
    owners, host = list(cap.untraced), []
    if is_detector(model):
        prefixes = npu_paths(model)
        host = [p for p in owners if not inside(p, prefixes)]
        owners = [p for p in owners if inside(p, prefixes)]
        part, x = NPUPart(model), example_batch(model)

        def run():
            part(x)
    elif example_inputs is not None:
        def run():
            model(*example_inputs)
    else:
        return [], [f"{p or '<root>'} ({t}): forward does not trace with torch.fx ({msg}); its submodules are still "
                    "swapped; pass example_inputs= to capture its functional ops by call site"
                    for p, (t, msg) in cap.untraced.items()]
    flow: list = []
    with eval_mode(model), quantizer_states(model, "off"), torch.no_grad():
        sites = discover(model, owners, run, flow, on_result)
    # a scatter-add / gather no recipe rule quantizes is listed as the (host) float op it is, as in
    # a traced forward (plan._functional_steps); its call then runs unrouted
    sites = [dataclasses.replace(s, kind=None) if s.kind is not None and call_form(s.kind) == "index"
             and resolve(s.path, s.kind, s.kind) is None else s for s in sites]
    roles = deformable_roles(sites, flow)  # multi-scale deformable attention (dal.prepare.deformable)
    flow.clear()
    count = {p: 0 for p in owners}
    for s in sites:
        count[s.owner] += 1
    notes = [f"{p or '<root>'} ({cap.untraced[p][0]}): forward does not trace with torch.fx ({cap.untraced[p][1]}); "
             f"{count[p]} call site(s) of its own code captured by a TorchFunctionMode (dal.prepare.call_sites)"
             for p in owners]
    notes += [f"{p or '<root>'} ({cap.untraced[p][0]}): host side of the detector boundary (pre/post-processing "
              "stays float on the host CPU, dal.prepare.boundary)" for p in host]
    steps = [deformable_step(s, roles[s.path], resolve) if s.path in roles else s for s in site_steps(sites, resolve)]
    for p in owners:
        mine = [r for path, r in roles.items() if path.startswith(f"{p}.dal_sites." if p else "dal_sites.")]
        if mine:
            notes.append(f"{p or '<root>'}: {mine.count('sampling')} sampling-arithmetic and {mine.count('weights')} "
                         "weighted-sum call site(s) of a multi-scale deformable attention (grid_sample per level, "
                         "weighted sum): op class deformable_attention where the recipe has a rule for it "
                         "(export/SPEC.md §5g)")
    return steps, notes
