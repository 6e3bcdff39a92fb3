"""Field checks shared by the hardware-model and recipe parsers.

A ``Checker`` collects ``Problem`` objects instead of raising at the first one, so a file with
three typos reports all three. Each helper returns the converted value, or ``None`` after
recording a problem naming the key, the bad value and what is allowed.
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable

from dal.config.nm_pattern import canonical_nm_pattern, nm_pattern_problem
from dal.config.problems import ConfigError, Problem
from dal.formats.qformat import FORMATS, QFormat, get_format


def closest(word: Any, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word`` (difflib), or None when nothing is close."""
    if not isinstance(word, str):
        return None
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: Any, choices: Iterable[str]) -> str:
    """``"; did you mean 'a2000'?"`` when a choice is close to ``word``, else ``""``."""
    near = closest(word, choices)
    return f"; did you mean {near!r}?" if near else ""


def type_name(value: Any) -> str:
    """The YAML word for the type of ``value`` (``integer``, ``string``, ``mapping``, ...)."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string",
            list: "list", tuple: "list", dict: "mapping"}.get(type(value), type(value).__name__)


def shown(value: Any) -> str:
    """``integer 3``, ``string '32'``; ``nothing`` for an empty YAML value."""
    if value is None:
        return "nothing (an empty value)"
    return f"{type_name(value)} {value!r}"


class Checker:
    """Collects problems while a parser walks a document."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, path: tuple, message: str) -> None:
        self.problems.append(Problem(message, tuple(path)))

    def extend(self, problems: Iterable[Problem], prefix: tuple = ()) -> None:
        self.problems.extend(p.prefixed(prefix) for p in problems)

    # -- structure -------------------------------------------------------------------------
    def mapping(self, value: Any, path: tuple, allowed: Iterable[str],
                required: Iterable[str] = ()) -> dict | None:
        """Check that ``value`` is a mapping with only ``allowed`` keys and all ``required`` ones.

        Every unknown key is reported (with the closest allowed key); returns the mapping
        (unknown keys included) so that the caller can keep checking the known ones.
        """
        allowed = list(allowed)
        if not isinstance(value, dict):
            self.add(path, f"expected a mapping with keys ({', '.join(allowed)}), "
                           f"got {shown(value)}")
            return None
        for key in value:
            if key not in allowed:
                self.add(tuple(path) + (key,), f"unknown key {key!r}{did_you_mean(key, allowed)} "
                                               f"(allowed keys: {', '.join(allowed)})")
        for key in required:
            if key not in value:
                self.add(path, f"missing required key {key!r}")
        return value

    def listing(self, value: Any, path: tuple, allow_scalar: bool = True) -> list | None:
        """A list; a single scalar counts as a one-item list when ``allow_scalar``."""
        if isinstance(value, list):
            return value
        if allow_scalar and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return [value]
        self.add(path, f"expected a list, got {shown(value)}")
        return None

    # -- scalars -----------------------------------------------------------------------------
    def string(self, value: Any, path: tuple, choices: Iterable[str] | None = None) -> str | None:
        if not isinstance(value, str):
            hint = f" (one of: {', '.join(choices)})" if choices is not None else ""
            self.add(path, f"expected a string{hint}, got {shown(value)}")
            return None
        if choices is not None:
            choices = list(choices)
            if value not in choices:
                self.add(path, f"{value!r} is not allowed{did_you_mean(value, choices)} "
                               f"(allowed: {', '.join(choices)})")
                return None
        return value

    def integer(self, value: Any, path: tuple, lo: int | None = None, hi: int | None = None) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.add(path, f"expected an integer, got {shown(value)}")
            return None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            self.add(path, f"{value!r} is out of range; expected an integer {rng}")
            return None
        return value

    def boolean(self, value: Any, path: tuple) -> bool | None:
        if not isinstance(value, bool):
            self.add(path, f"expected true or false, got {shown(value)}")
            return None
        return value

    def strings(self, value: Any, path: tuple, choices: Iterable[str] | None = None) -> tuple[str, ...] | None:
        items = self.listing(value, path)
        if items is None:
            return None
        out = [self.string(v, tuple(path) + (i,), choices) for i, v in enumerate(items)]
        return None if any(v is None for v in out) else tuple(out)

    def nm_pattern(self, value: Any, path: tuple) -> str | None:
        """An N:M sparsity pattern (``dal.config.nm_pattern``: ``1 <= N < M <= 16``), canonical text."""
        problem = nm_pattern_problem(value)
        if problem is not None:
            self.add(path, problem)
            return None
        return canonical_nm_pattern(value)

    def nm_patterns(self, value: Any, path: tuple) -> tuple[str, ...] | None:
        """A list of N:M patterns (a single one counts as a one-item list)."""
        items = self.listing(value, path)
        if items is None:
            return None
        out = [self.nm_pattern(v, tuple(path) + (i,)) for i, v in enumerate(items)]
        return None if any(v is None for v in out) else tuple(out)

    def qformat(self, value: Any, path: tuple) -> QFormat | None:
        if isinstance(value, QFormat):
            return value
        try:
            return get_format(value)
        except ValueError:
            self.add(path, f"{value!r} is not a known format{did_you_mean(str(value).lower(), FORMATS)} "
                           f"(known formats: {', '.join(FORMATS)})")
            return None

    def qformats(self, value: Any, path: tuple) -> tuple[QFormat, ...] | None:
        items = self.listing(value, path)
        if items is None:
            return None
        out = [self.qformat(v, tuple(path) + (i,)) for i, v in enumerate(items)]
        return None if any(v is None for v in out) else tuple(out)

    def scalar_args(self, value: Any, path: tuple) -> tuple[tuple[str, Any], ...] | None:
        """A mapping of name -> scalar (or list of scalars) as a sorted tuple of pairs."""
        if value is None:
            return ()
        if not isinstance(value, dict):
            self.add(path, f"expected a mapping of argument names to values, got {shown(value)}")
            return None
        out = []
        for k, v in value.items():
            if not isinstance(k, str):
                self.add(tuple(path) + (k,), f"argument name {k!r} must be a string")
                continue
            if isinstance(v, list):
                v = tuple(v)
            items = v if isinstance(v, tuple) else (v,)
            if not all(x is None or isinstance(x, (bool, int, float, str)) for x in items):
                self.add(tuple(path) + (k,), f"argument value {v!r} must be a number, string, "
                                             "boolean or a list of those")
                continue
            out.append((k, v))
        return tuple(sorted(out))

    # -- construction --------------------------------------------------------------------------
    def build(self, path: tuple, cls, *args, **kwargs):
        """Construct ``cls(*args, **kwargs)``; its validation errors are recorded under ``path``."""
        try:
            return cls(*args, **kwargs)
        except ConfigError as e:
            self.extend(e.problems, tuple(path))
            return None

    def raise_if_any(self, error_cls: type[ConfigError], doc=None) -> None:
        """Raise ``error_cls`` with every recorded problem, located in ``doc`` when given."""
        if self.problems:
            problems = doc.locate(self.problems) if doc is not None else self.problems
            raise error_cls(problems)
