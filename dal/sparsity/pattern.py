"""N:M sparsity patterns: at most N non-zeros in every group of M consecutive weights.

A pattern is parsed once from the user's string (``"2:4"``) into a frozen :class:`NMPattern`;
everything downstream takes the parsed object. The parser and its one rule
(``1 <= N < M <= 16``) live in ``dal.config.nm_pattern``, shared with recipes and hardware
models, which check their patterns with it when they are loaded; a pattern passed to
``prepare_sparse`` directly fails there with a message that says what is accepted.
"""
from __future__ import annotations

from dal.config.nm_pattern import MAX_GROUP, NMPattern, parse_nm_pattern

__all__ = ["MAX_GROUP", "NMPattern", "parse_pattern"]


def parse_pattern(pattern: "str | NMPattern") -> NMPattern:
    """``"2:4"`` -> ``NMPattern(2, 4)``; an :class:`NMPattern` passes through.

    Raises ``TypeError`` for a non-string and ``ValueError`` for anything that is not
    ``"N:M"`` with ``1 <= N < M <= 16`` (``dal.config.parse_nm_pattern``).

    >>> parse_pattern("4:8")
    NMPattern(n=4, m=8)
    """
    return parse_nm_pattern(pattern)
