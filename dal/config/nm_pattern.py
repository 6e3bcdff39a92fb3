"""N:M sparsity patterns, parsed by one rule for recipes, hardware models and dal.sparsity.

A pattern keeps at most ``N`` non-zeros in every group of ``M`` consecutive weights. It is
written ``"N:M"`` (ASCII digits, spaces around the numbers allowed) with
``1 <= N < M <= MAX_GROUP`` (16, the largest group the mask code in ``dal.sparsity`` is
written and tested for). Recipes and hardware models check their patterns with this module
when they are loaded, so a bad one fails there with file, line and key, and store the
canonical text (``str(NMPattern)``, e.g. ``"2:4"``) so that patterns compare as strings.

    >>> parse_nm_pattern(" 4 : 8 ")
    NMPattern(n=4, m=8)
    >>> nm_pattern_problem("1:32")
    "sparsity pattern '1:32' is not supported: need N:M with 1 <= N < M <= 16 (for example '2:4', '1:4' or '4:8')"
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_GROUP", "NMPattern", "canonical_nm_pattern", "nm_pattern_problem", "parse_nm_pattern"]

#: The largest group size M of a supported pattern.
MAX_GROUP = 16
_TEXT = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*", re.ASCII)
_EXAMPLES = "(for example '2:4', '1:4' or '4:8')"


@dataclass(frozen=True)
class NMPattern:
    """Keep ``n`` of every ``m`` consecutive weights along the reduction dimension.

    Contract: ``1 <= n < m <= MAX_GROUP`` (16); ``TypeError`` for non-integers, ``ValueError``
    otherwise. Density of a fully pruned tensor is ``n / m``.

    >>> NMPattern(2, 4).density
    0.5
    """

    n: int
    m: int

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.n, self.m)):
            raise TypeError(f"NMPattern(n, m) takes ints, got n={self.n!r}, m={self.m!r}")
        if not 1 <= self.n < self.m <= MAX_GROUP:
            raise ValueError(f"N:M pattern {self.n}:{self.m} is invalid: need 1 <= N < M <= {MAX_GROUP} "
                             f"{_EXAMPLES}")

    @property
    def density(self) -> float:
        """Fraction of weights kept, ``n / m``."""
        return self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def parse_nm_pattern(pattern: "str | NMPattern") -> NMPattern:
    """``"2:4"`` -> ``NMPattern(2, 4)``; an :class:`NMPattern` passes through.

    Raises ``TypeError`` when ``pattern`` is neither a string nor an ``NMPattern``, and
    ``ValueError`` (whose message is ``nm_pattern_problem(pattern)``) for a string that is not
    ``"N:M"`` with ``1 <= N < M <= 16``.

    >>> parse_nm_pattern("4:8")
    NMPattern(n=4, m=8)
    """
    if isinstance(pattern, NMPattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"a sparsity pattern is a string like '2:4', got {type(pattern).__name__} {pattern!r}")
    problem = nm_pattern_problem(pattern)
    if problem is not None:
        raise ValueError(problem)
    n, m = _TEXT.fullmatch(pattern).groups()
    return NMPattern(int(n), int(m))


def nm_pattern_problem(pattern: Any) -> str | None:
    """What is wrong with ``pattern`` as an N:M sparsity pattern, or None when it is valid.

    The text says what is accepted; for an integer it adds that YAML reads an unquoted
    ``2:4`` as a base-60 number (124), so the pattern must be quoted.

    >>> nm_pattern_problem("2:4") is None, nm_pattern_problem(NMPattern(1, 4)) is None
    (True, True)
    """
    if isinstance(pattern, NMPattern):
        return None
    if not isinstance(pattern, str):
        hint = ""
        if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 60:
            # YAML 1.1 reads an unquoted N:M as the base-60 number 60 * N + M (2:4 -> 124)
            n, m = divmod(pattern, 60)
            hint = f" (YAML read an unquoted {n}:{m} as the base-60 number {pattern}: write it in quotes, \"{n}:{m}\")"
        return f"a sparsity pattern is a string such as \"2:4\", got {type(pattern).__name__} {pattern!r}{hint}"
    found = _TEXT.fullmatch(pattern)
    if found is None:
        return (f"sparsity pattern {pattern!r} is not of the form 'N:M' {_EXAMPLES}; only N:M structured "
                "sparsity is supported")
    n, m = int(found.group(1)), int(found.group(2))
    if not 1 <= n < m <= MAX_GROUP:
        return f"sparsity pattern {pattern!r} is not supported: need N:M with 1 <= N < M <= {MAX_GROUP} {_EXAMPLES}"
    return None


def canonical_nm_pattern(pattern: "str | NMPattern") -> str:
    """The canonical text of a valid pattern (``" 2 : 4"`` -> ``"2:4"``); raises like ``parse_nm_pattern``."""
    return str(parse_nm_pattern(pattern))
