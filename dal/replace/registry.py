"""Registry of replacement rules: a dict plus the ``@dal.replace.rule(name)`` decorator.

A rule says which modules it replaces and how to build the replacement:

    @dal.replace.rule("my_gelu")
    class MyGelu:
        def match(self, module, name) -> bool:          # is this module mine?
            return isinstance(module, nn.GELU)
        def build(self, module, hardware) -> nn.Module:  # the replacement, sharing module's Parameters
            return MyHardwareGelu(module)

``match`` may take a third argument, the hardware model (or None), to match only what that
hardware needs. Optional: ``describe(module, name) -> str`` (a detail for the report) and ``why_nothing(hardware)
-> str`` (why the rule matches nothing on this hardware, e.g. bilinear resize is supported).
``build`` may return ``module`` itself: the rule only reports (``conv_bn_relu``); such a rule
sets ``claims_subtree = False`` so later rules still see the modules inside. ``after_swap(model,
path, new) -> [notes]`` runs once the swap is done (fix-ups that must not happen if it aborts).
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Callable

#: rule name -> rule object (an instance of the decorated class)
RULES: dict[str, object] = {}

# The built-in rules register themselves (``@rule``) when their module of this package is
# imported, which load_builtins does on first lookup, not at ``import dal``.
_builtins_loaded = False


def rule(name: str) -> Callable:
    """Register the decorated class (instantiated without arguments) or object as rule ``name``.

    The rule needs ``match(module, name) -> bool`` and ``build(module, hardware) -> nn.Module``.
    Registering a name again replaces the earlier rule (users may override a built-in).
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"rule name must be an identifier such as 'my_rule', got {name!r}")
    load_builtins()  # first, so a user rule that overrides a built-in is not overwritten later

    def wrap(obj):
        inst = obj() if isinstance(obj, type) else obj
        missing = [m for m in ("match", "build") if not callable(getattr(inst, m, None))]
        if missing:
            raise TypeError(f"replacement rule {name!r} ({getattr(obj, '__name__', obj)!r}) lacks {missing}: "
                            "define match(module, name) -> bool and build(module, hardware) -> nn.Module")
        inst.rule_name = name
        RULES[name] = inst
        return obj
    return wrap


def load_builtins() -> None:
    """Import every module of this package (once), so each built-in ``@rule`` registers.

    A new built-in rule needs only its decorator, in any module of ``dal/replace``."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
            importlib.import_module(f"{__package__}.{info.name}")


def known_rules() -> list[str]:
    load_builtins()
    return sorted(RULES)


def get_rules(names) -> list[tuple[str, object]]:
    """``[(name, rule)]`` for ``names``; unknown names raise one ValueError listing all of them."""
    load_builtins()
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in RULES]
    if unknown:
        import difflib

        hints = []
        for n in unknown:
            close = difflib.get_close_matches(str(n), list(RULES), n=1)
            hints.append(f"{n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown replacement rule(s) {', '.join(hints)}; known rules: {', '.join(sorted(RULES))}. "
                         "Register your own with @dal.replace.rule('name')")
    return [(n, RULES[n]) for n in names]
