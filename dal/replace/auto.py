"""auto_replace: apply replacement rules to a model, transactionally, and report the drift."""
from __future__ import annotations

from typing import Optional

import contextlib

import torch
from torch import nn

from ..capture import Record, recording
from ..nn.base import QATModule
from ..nn.modes import eval_mode
from ..nn.tree import set_submodule
from .registry import get_rules
from .report import Replacement, ReplaceReport, RuleFailure


def _load_hw(hardware):
    if hardware is None:
        return None
    from ..hardware import load_hardware

    return load_hardware(hardware)


def _first_error_line(err: BaseException) -> str:
    text = str(err).splitlines()[0][:200] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _takes_hardware(fn) -> bool:
    """Does a rule's ``match`` accept a third argument (the hardware model)?"""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _inside(path: str, claimed: list[str]) -> bool:
    return any(c == "" or path == c or path.startswith(c + ".") for c in claimed)


def _name_quantizers(new: nn.Module, path: str) -> None:
    """Give the QAT-protocol modules and quantizers a replacement built the full module path
    (rules build without knowing where the module goes; errors and exports name by path)."""
    from ..quantizer import FakeQuantizer

    for sub, m in new.named_modules():
        full = ".".join(p for p in (path, sub) if p)
        if isinstance(m, FakeQuantizer):
            m.name = full
        elif isinstance(m, QATModule):
            m.qat_name = full


def _tensor_of(out):
    if torch.is_tensor(out):
        return out
    if isinstance(out, (list, tuple)):
        for o in out:
            t = _tensor_of(o)
            if t is not None:
                return t
    return None


def _capture(model: nn.Module, modules: dict[str, nn.Module], example_inputs: tuple,
             record: Optional[Record] = None) -> dict[str, torch.Tensor]:
    """Every output of each module in ``modules`` on one eval-mode, no-grad run of ``model``,
    recorded into ``record`` by ``dal.capture`` when given.

    Eval mode because dropout would make before and after incomparable; each module's own
    training flag is restored afterwards.
    """
    seen: dict[str, list] = {p: [] for p in modules}
    hooks = []
    for path, mod in modules.items():
        def hook(m, i, o, path=path):
            t = _tensor_of(o)
            if t is not None:
                seen[path].append(t.detach().float().flatten())
        hooks.append(mod.register_forward_hook(hook))
    recorded = recording(model, into=record) if record is not None else contextlib.nullcontext()
    try:
        with eval_mode(model), torch.no_grad(), recorded:
            model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return {p: torch.cat(v) for p, v in seen.items() if v}


def _swap_back(model: nn.Module, swaps: list) -> nn.Module:
    """Put every original module back (deepest paths first); returns the root."""
    for _, _, path, mod, _ in sorted(swaps, key=lambda b: -(b[2].count(".") + bool(b[2]))):
        if path == "":
            model = mod
        else:
            set_submodule(model, path, mod)
    return model


def _culprit(model: nn.Module, swaps: list, example_inputs: tuple) -> tuple[str, str]:
    """(rule, path) of the innermost replaced module running when the forward raised."""
    running: list[tuple[str, str]] = []

    def finished(module, args, out) -> None:  # returns None: the module's output stays as it is
        running.pop()

    hooks = []
    for rname, _, path, _, new in swaps:
        hooks.append(new.register_forward_pre_hook(lambda m, i, tag=(rname, path): running.append(tag)))
        hooks.append(new.register_forward_hook(finished))
    try:
        with eval_mode(model), torch.no_grad():
            model(*example_inputs)
    except Exception:  # noqa: BLE001 - the same failure again; now we know where
        pass
    finally:
        for h in hooks:
            h.remove()
    if running:
        return running[-1]
    return ", ".join(sorted({r for r, *_ in swaps})), "<model forward>"


def _drift(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> tuple[Optional[float], Optional[float]]:
    if a is None or b is None or a.shape != b.shape:
        return None, None
    a64, b64 = a.double(), b.double()
    denom = a64.norm() * b64.norm()
    cos = float((a64 @ b64) / denom) if denom > 0 else (1.0 if torch.equal(a, b) else 0.0)
    return cos, float((a64 - b64).abs().max()) if a.numel() else 0.0


def auto_replace(model: nn.Module, rules=None, hardware=None, example_inputs=None,
                 strict: bool = False, scope: Optional[dict] = None, record: Optional[Record] = None) -> ReplaceReport:
    """Replace operators of ``model`` (in place) by the hardware's own versions; return a report.

    Args:
        model: a float ``nn.Module`` (before ``prepare_qat``; prepare calls this for the recipe's
            ``replace:`` list).
        rules: rule names (see :func:`dal.replace.known_rules`), applied in order; None = the
            hardware model's ``replace_rules_needed``.
        hardware: a ``HardwareModel``, bundled name or path; the rules read ``lut_size``,
            ``fp16_ops``, ``lut_ops``, ``resize_modes`` from it (None: generic choices).
        example_inputs: a tuple of inputs; with it each replacement reports the cosine and max
            abs difference of its module's output before and after (forward hooks, eval mode).
        strict: raise instead of reporting when a rule fails.
        scope: ``{rule name: predicate(path, module) -> bool}``; a rule named here is only offered
            the modules its predicate accepts (prepare uses it for recipe rules' own ``replace:``
            lists, which apply to the layers those recipe rules match). Other rules see every module.
        record: a ``dal.capture.Record`` that the forward checking the swaps (on the replaced model)
            is recorded into; it stays empty when that forward does not run (no example inputs,
            nothing swapped) or a replacement is undone. prepare reads it as its float forward.

    Contract:
        * each rule's ``match(module, path)`` is asked top-down; a module replaced by one rule
          is not offered (nor its submodules) to later rules;
        * all replacements are built first, then swapped: if any ``build`` (or ``match``)
          raises, nothing is swapped and the report lists the rule, path and error;
        * with ``example_inputs``, a replacement whose forward raises there, or whose output
          is not finite where the original's was, is reported by rule and path and every
          swap is undone (``report.applied`` is False; the model is as it was, except what
          a rule's ``after_swap`` changed, such as a TransformerEncoder's fast-path flag);
        * unknown rule names raise ``ValueError`` listing the known rules;
        * a rule that matches nothing is listed by name in ``report.unmatched``, with a reason.

    Example:
        >>> rep = dal.replace.auto_replace(model, ["npu_attention"], "a2000", (x,))  # doctest: +SKIP
        >>> print(rep.summary())
        npu_attention: 12 replaced (min cosine 1.000000, max |diff| 4.8e-07)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_replace needs an nn.Module, got {type(model).__name__}")
    hw = _load_hw(hardware)
    names = list(rules) if rules is not None and not isinstance(rules, str) else ([rules] if rules else None)
    if names is None:
        names = list(getattr(hw, "replace_rules_needed", ()) or ())
    pairs = get_rules(names)
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    report = ReplaceReport(rules=[n for n, _ in pairs], model=model)

    plans = _match_all(model, pairs, hw, scope, report)
    built = _build_all(plans, hw, report)
    if report.failed:
        return _refused(report, strict)

    swaps = [b for b in built if b[4] is not b[3]]
    try:
        before = _capture(model, {p: m for _, _, p, m, _ in swaps}, example_inputs) if example_inputs and swaps else {}
    except Exception as err:
        shapes = [tuple(t.shape) for t in example_inputs if torch.is_tensor(t)]
        raise ValueError(f"auto_replace: the model fails on example_inputs (shapes {shapes}) before any "
                         f"replacement: {_first_error_line(err)}") from err

    report.model = model = _swap_in(model, built, report)
    after, broken = _check_swaps(model, swaps, before, example_inputs, record)
    if broken:
        if record is not None:
            record.take(Record())  # it recorded a model that is given back
        for rname, path, why in broken:
            report.failed.append(RuleFailure(rname, path, why))
        report.model = _swap_back(model, swaps)
        return _refused(report, strict)
    _record_replacements(report, built, before, after)
    return report


def _match_all(model: nn.Module, pairs: list, hw, scope: Optional[dict], report: ReplaceReport) -> list:
    """Step 1, match: (rule name, rule, path, module) top-down, the first rule wins a subtree.
    A ``match`` that raises goes to ``report.failed``; a rule matching nothing to ``unmatched``."""
    plans, claimed = [], []
    for rname, r in pairs:
        found = 0
        where = (scope or {}).get(rname)
        for path, mod in model.named_modules():
            if _inside(path, claimed) or (where is not None and not where(path, mod)):
                continue
            try:
                hit = bool(r.match(mod, path, hw) if _takes_hardware(r.match) else r.match(mod, path))
            except Exception as err:  # noqa: BLE001 - a user's match is reported, not fatal
                report.failed.append(RuleFailure(rname, path, f"match raised {_first_error_line(err)}"))
                continue
            if hit:
                plans.append((rname, r, path, mod))
                found += 1
                if getattr(r, "claims_subtree", True):
                    claimed.append(path)
        if not found and not any(f.rule == rname for f in report.failed):
            why = getattr(r, "why_nothing", None)
            reason = (why(hw) if callable(why) else None) or "no module matched"
            report.unmatched[rname] = reason if where is None else f"{reason} (among the modules its scope allows)"
    return plans


def _build_all(plans: list, hw, report: ReplaceReport) -> list:
    """Step 2: build every replacement before touching the model; (rule name, rule, path,
    module, replacement). A ``build`` that raises goes to ``report.failed``."""
    built = []
    for rname, r, path, mod in plans:
        try:
            new = r.build(mod, hw)
            if not isinstance(new, nn.Module):
                raise TypeError(f"build returned {type(new).__name__}, not an nn.Module")
        except Exception as err:  # noqa: BLE001 - reported by rule name; the model stays intact
            report.failed.append(RuleFailure(rname, path, f"build raised {_first_error_line(err)}"))
            continue
        built.append((rname, r, path, mod, new))
    return built


def _refused(report: ReplaceReport, strict: bool) -> ReplaceReport:
    """The report of a run that changed nothing (``applied`` False); raises instead if strict."""
    report.applied = False
    if strict:
        raise RuntimeError("auto_replace: " + "; ".join(f"{f.rule} at {f.path or '<root>'}: {f.error}"
                                                        for f in report.failed))
    return report


def _swap_in(model: nn.Module, built: list, report: ReplaceReport) -> nn.Module:
    """Step 3: swap, shallow paths first (a rebuilt parent keeps the same child objects), name
    the new quantizers by path, run the rules' ``after_swap``; returns the root."""
    for rname, r, path, mod, new in sorted(built, key=lambda b: b[2].count(".") + bool(b[2])):
        if new is mod:
            continue
        if path == "":
            model = new
        else:
            set_submodule(model, path, new)
    for rname, r, path, mod, new in built:
        if new is not mod:
            _name_quantizers(new, path)
        hook = getattr(r, "after_swap", None)
        if callable(hook):
            report.notes.extend(hook(model, path, new) or [])
    return model


def _check_swaps(model: nn.Module, swaps: list, before: dict, example_inputs,
                 record: Optional[Record] = None) -> tuple[dict, list]:
    """(outputs after the swap, broken): broken lists (rule, path, why) for a replacement whose
    forward raises, or whose output is not finite where the original's was. The forward is
    recorded into ``record`` when given."""
    try:
        after = _capture(model, {p: n for _, _, p, _, n in swaps}, example_inputs, record) if before else {}
        broken = [(rname, path, "its output on the example inputs is not finite (the original's is)")
                  for rname, _, path, _, _ in swaps
                  if path in after and bool(torch.isfinite(before.get(path, after[path])).all())
                  and not bool(torch.isfinite(after[path]).all())]
    except Exception as err:  # noqa: BLE001 - a replacement that breaks the forward is reported, then undone
        rname, path = _culprit(model, swaps, example_inputs)
        return {}, [(rname, path, f"forward on the example inputs raised {_first_error_line(err)}")]
    return after, broken


def _record_replacements(report: ReplaceReport, built: list, before: dict, after: dict) -> None:
    """One ``Replacement`` per built module: kept ones with the rule's note, swapped ones with
    the output drift (cosine, max abs difference) when example inputs were given."""
    for rname, r, path, mod, new in built:
        describe = getattr(r, "describe", None)
        detail = describe(mod, path) if callable(describe) else ""
        if new is mod:
            report.replacements.append(Replacement(rname, path, type(mod).__name__, type(mod).__name__,
                                                   "kept: " + (detail or "nothing to change")))
            continue
        cos, mad = _drift(before.get(path), after.get(path))
        report.replacements.append(Replacement(rname, path, type(mod).__name__, type(new).__name__, detail, cos, mad))
