"""N:M sparsity patterns: at most N non-zeros in every group of M consecutive weights.

A pattern is parsed once from the user's string (``"2:4"``) into a frozen :class:`NMPattern`;
everything downstream takes the parsed object, so a typo fails at ``prepare_sparse`` time with
a message that says what is accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NMPattern", "parse_pattern"]


@dataclass(frozen=True)
class NMPattern:
    """Keep ``n`` of every ``m`` consecutive weights along the reduction dimension.

    Contract: ``1 <= n < m <= 16``. Density of a fully pruned tensor is ``n / m``.

    >>> NMPattern(2, 4).density
    0.5
    """

    n: int
    m: int

    def __post_init__(self) -> None:
        if not (isinstance(self.n, int) and isinstance(self.m, int)):
            raise TypeError(f"NMPattern(n, m) takes ints, got n={self.n!r}, m={self.m!r}")
        if not 1 <= self.n < self.m <= 16:
            raise ValueError(
                f"N:M pattern {self.n}:{self.m} is invalid: need 1 <= N < M <= 16 "
                "(for example '2:4', '1:4' or '4:8')")

    @property
    def density(self) -> float:
        return self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def parse_pattern(pattern: "str | NMPattern") -> NMPattern:
    """``"2:4"`` -> ``NMPattern(2, 4)``; an :class:`NMPattern` passes through.

    Raises ``ValueError`` for anything that is not ``"N:M"`` with ``1 <= N < M <= 16``.

    >>> parse_pattern("4:8")
    NMPattern(n=4, m=8)
    """
    if isinstance(pattern, NMPattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a string like '2:4', got {type(pattern).__name__}")
    parts = pattern.strip().split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"sparsity pattern {pattern!r} is not of the form 'N:M' (for example '2:4', "
            "'1:4', '4:8'); only N:M structured sparsity is supported")
    return NMPattern(int(parts[0]), int(parts[1]))
