"""Configuration errors that name the file, line, key and bad value, several at once.

Hardware models and recipes are checked completely before an error is raised, so one run
shows every problem in a file. Each problem is a ``Problem``; the exception's message has
one line per problem, ``file:line: key: message``.

    >>> str(Problem("expected an integer", ("rules", 2, "weight"), "r.yaml", 7))
    'r.yaml:7: rules[2].weight: expected an integer'
"""
from __future__ import annotations

from dataclasses import dataclass, replace


def format_path(path: tuple) -> str:
    """``("rules", 2, "weight", "format")`` -> ``"rules[2].weight.format"``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a configuration.

    Attributes:
        message: what is wrong, the bad value, what is allowed and how to fix it.
        path: key path inside the document (``("ops", "conv", "engine")``), () for the whole file.
        source: file name, ``"<dict>"`` or ``None`` when unknown.
        line: 1-based line of the key in ``source``, ``None`` when unknown.
    """

    message: str
    path: tuple = ()
    source: str | None = None
    line: int | None = None

    @property
    def key(self) -> str:
        """The key path as text, ``rules[2].weight``."""
        return format_path(self.path)

    def located(self, source: str | None, line: int | None) -> "Problem":
        """A copy with ``source`` / ``line`` filled in where this problem has none."""
        return replace(self, source=self.source or source, line=self.line or line)

    def prefixed(self, prefix: tuple) -> "Problem":
        """A copy whose key path starts with ``prefix`` (a problem of a sub-object, placed)."""
        return replace(self, path=tuple(prefix) + tuple(self.path))

    def __str__(self) -> str:
        where = ""
        if self.source:
            where = self.source + (f":{self.line}" if self.line else "")
        head = ": ".join(p for p in (where, self.key) if p)
        return f"{head}: {self.message}" if head else self.message


class ConfigError(ValueError):
    """A configuration file or object is invalid; ``problems`` lists every problem found.

    ``problems`` may be one ``Problem``, one string, or a list of either; ``what`` overrides
    the class's noun in the message (``invalid recipe 'x' for hardware 'y': ...``).
    """

    what = "configuration"

    def __init__(self, problems, what: str | None = None):
        if isinstance(problems, (str, Problem)):
            problems = [problems]
        self.problems: tuple[Problem, ...] = tuple(
            p if isinstance(p, Problem) else Problem(str(p)) for p in problems)
        if what is not None:
            self.what = what
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"invalid {self.what}: {self.problems[0]}"
        lines = [f"invalid {self.what}: {len(self.problems)} problems"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)
