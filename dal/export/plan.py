"""Before tracing: which quantizers the model holds, whether they can be exported, and the opset.

Every refusal is collected first and raised once, so a user fixes all offenders in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..quantizer import FakeQuantizer
from .errors import ExportError

#: the lowest opset dal writes: per-channel QuantizeLinear / DequantizeLinear (``axis``) need 13
MIN_OPSET = 13
#: the TorchScript exporter traces at most this opset; newer ones are reached by raising the import
TRACE_MAX_OPSET = 20
#: the newest opset dal writes (opsets 21..23 only add element types to the operators torch emits)
MAX_OPSET = 23

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass
class QuantizerEntry:
    """One FakeQuantizer of the model and the module that owns it."""

    name: str                 # module path of the quantizer ("layer1.0.conv1.input_quant")
    quantizer: FakeQuantizer
    owner_name: str           # path of the nearest non-container ancestor ("layer1.0.conv1")
    owner: Optional[nn.Module]

    @property
    def active(self) -> bool:
        """Does the quantizer change its input (and so appear in the graph)?"""
        return self.quantizer.state != "off"

    def required_opset(self) -> int:
        """The lowest opset whose QuantizeLinear / DequantizeLinear / Cast can carry this quantizer."""
        q = self.quantizer
        need = max(q.fmt.min_opset, MIN_OPSET if q.fmt.is_scaled and q.granularity.axis is not None else 1)
        if q.granularity.block_size:
            need = max(need, 21)  # blocked quantization (block_size attribute) arrived in opset 21
        # a QAT module whose exported operator needs a newer opset says so (QScatterAdd: 16)
        return max(need, int(getattr(self.owner, "min_opset", 1)))


@dataclass
class ExportPlan:
    entries: list[QuantizerEntry]

    @property
    def active(self) -> list[QuantizerEntry]:
        return [e for e in self.entries if e.active]

    def default_opset(self) -> int:
        return max([MIN_OPSET] + [e.required_opset() for e in self.active])

    def resolve_opset(self, opset: Optional[int]) -> int:
        """``opset`` checked against every active quantizer, or the lowest that carries them all."""
        if opset is None:
            return self.default_opset()
        opset = int(opset)
        if not MIN_OPSET <= opset <= MAX_OPSET:
            raise ExportError(f"opset={opset} is outside what dal writes ({MIN_OPSET}..{MAX_OPSET}); "
                              f"leave opset=None to get {self.default_opset()}")
        short = [e for e in self.active if e.required_opset() > opset]
        if short:
            lines = [f"  {e.name}: {e.quantizer.fmt.name} {e.quantizer.granularity} needs opset >= "
                     f"{e.required_opset()}" for e in short]
            raise ExportError(f"opset={opset} cannot carry {len(short)} quantizer(s) of this model:\n"
                              + "\n".join(lines)
                              + f"\npass opset>={max(e.required_opset() for e in short)} or opset=None")
        return opset


def _owner(model: nn.Module, path: str) -> tuple[str, Optional[nn.Module]]:
    """The nearest ancestor of ``path`` that is not a container (QAdd owns ``input_quants.0``)."""
    parts = path.split(".")[:-1]
    mods = dict(model.named_modules())
    while parts:
        name = ".".join(parts)
        mod = mods.get(name)
        if mod is not None and not isinstance(mod, _CONTAINERS):
            return name, mod
        parts.pop()
    return "", model


def _is_qat_module(mod: nn.Module) -> bool:
    from ..nn.base import QATModule

    return isinstance(mod, QATModule)


def _invalid_qparams(q: FakeQuantizer) -> Optional[str]:
    """Why ``q``'s scale / zero point cannot be written to an ONNX file, or None.

    ONNX needs a finite, positive scale and a zero point of the format's own element type; a
    value outside the format's codes would wrap in the file and compute something else than
    the torch model did.
    """
    scale = q.scale.detach().float()
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        return f"scale {scale.flatten()[:4].tolist()} is not finite and positive"
    if q.fmt.is_float8:
        return None
    zp = torch.round(q.zero_point.detach().float())
    if not bool(torch.isfinite(zp).all()) or bool(((zp < q.qmin) | (zp > q.qmax)).any()):
        return (f"zero point {zp.flatten()[:4].tolist()} is outside {q.fmt.name}'s codes "
                f"[{q.qmin:g}, {q.qmax:g}]")
    return None


def _invalid_weight(e: QuantizerEntry) -> Optional[str]:
    """A weight quantizer whose weight holds NaN / inf: torch computes NaN, the file would not."""
    weight = getattr(e.owner, "weight", None)
    if not e.name.endswith("weight_quant") or not isinstance(weight, torch.Tensor):
        return None
    bad = int((~torch.isfinite(weight.detach())).sum())
    return f"{bad} weight value(s) of {e.owner_name} are NaN or infinite" if bad else None


def make_plan(model: nn.Module) -> ExportPlan:
    """Collect the model's quantizers; refuse uncalibrated ones and quantizers the exporter cannot place.

    Raises ExportError listing (all at once): quantizers still observing (not calibrated),
    quantizers switched on without a scale, quantizers held by modules that are not QAT
    modules (the exporter knows the roles - input, weight, output - only of QAT modules),
    scales that are not finite and positive, zero points outside the format's codes, and
    weights holding NaN or inf.
    """
    entries = []
    for name, mod in model.named_modules():
        if isinstance(mod, FakeQuantizer):
            owner_name, owner = _owner(model, name)
            entries.append(QuantizerEntry(name, mod, owner_name, owner))
    observing = [e for e in entries if e.quantizer.state == "observe" and e.quantizer.fmt.is_scaled]
    if observing:
        names = "\n".join(f"  {e.name} ({e.quantizer.fmt.name})" for e in observing)
        raise ExportError(
            f"{len(observing)} quantizer(s) are still in state 'observe' (not calibrated / not frozen), so "
            f"they have no trained scale to export:\n{names}\n"
            "run dal.calibrate(model, data) (or quantizer.set_state('frozen')) before dal.export_onnx")
    unset = [e for e in entries if e.active and e.quantizer.fmt.is_scaled and not e.quantizer.initialized]
    for e in entries:  # what the next forward would do after the last optimizer step
        e.quantizer.project_learned_qparams_()
    unplaced = [e for e in entries if e.active and e.owner is not model and not _is_qat_module(e.owner)]
    invalid = [(e, why) for e in entries if e.active and e.quantizer.fmt.is_scaled and e.quantizer.initialized
               and (why := _invalid_qparams(e.quantizer))]
    invalid += [(e, why) for e in entries if e.active and (why := _invalid_weight(e))]
    if unplaced or unset or invalid:
        lines = [f"  {e.name}: held by {type(e.owner).__name__} '{e.owner_name}', which is not a QAT module; "
                 "wrap it with a class registered by dal.register_qat_module or set the quantizer 'off'"
                 for e in unplaced]
        lines += [f"  {e.name}: state '{e.quantizer.state}' but no scale; calibrate it first" for e in unset]
        lines += [f"  {e.name}: {why}" for e, why in invalid]
        raise ExportError(f"the exporter cannot place {len(lines)} quantizer(s):\n" + "\n".join(lines))
    return ExportPlan(entries)
