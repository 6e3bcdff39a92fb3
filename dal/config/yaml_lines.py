"""YAML loading that remembers the line of every key, for errors that point into the file.

``load_yaml_file(path)`` returns a ``YamlDoc``: the plain Python data (dicts, lists, scalars;
exactly what ``yaml.safe_load`` gives, anchors and ``<<`` merge keys included) plus a map from
each key path to its 1-based line. Parsers validate ``doc.data`` and turn a key path into
``file:line`` with ``doc.line(path)``. Duplicate keys in one mapping, which ``safe_load``
silently collapses, are reported.

    >>> doc = load_yaml_text("a:\\n  b: 1\\n", "x.yaml")
    >>> doc.data, doc.line(("a", "b"))
    ({'a': {'b': 1}}, 2)

Syntax errors raise ``error_cls`` (a ``ConfigError``) with the file and the line.
Used by both ``dal.hardware`` and ``dal.recipe``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dal.config.problems import ConfigError, Problem


@dataclass(frozen=True)
class YamlDoc:
    """Loaded YAML data with the line of every key path.

    Attributes:
        data: the document as plain Python objects.
        source: file path as given, or a label such as ``"<dict>"``.
        lines: key path (tuple of keys / list indices) -> 1-based line of that key or item.
    """

    data: Any
    source: str
    lines: dict = field(default_factory=dict, compare=False, repr=False)

    def line(self, path: tuple) -> int | None:
        """Line of ``path``, or of its nearest ancestor that has one; None if unknown."""
        path = tuple(path)
        while True:
            if path in self.lines:
                return self.lines[path]
            if not path:
                return None
            path = path[:-1]

    def where(self, path: tuple = ()) -> str:
        """``"file:line"`` for ``path`` (just ``"file"`` when the line is unknown)."""
        line = self.line(path)
        return f"{self.source}:{line}" if line else self.source

    def locate(self, problems) -> list[Problem]:
        """Fill in source and line of problems that carry only a key path."""
        return [p.located(self.source, self.line(p.path)) for p in problems]


def from_data(data: Any, source: str = "<dict>") -> YamlDoc:
    """Wrap already-loaded data (a dict written in Python) as a document without lines."""
    return YamlDoc(data, source, {})


def load_yaml_file(path, error_cls: type[ConfigError] = ConfigError, label: str | None = None) -> YamlDoc:
    """Read and parse a YAML file; raise ``error_cls`` if it cannot be read or parsed.

    ``label`` names the file in messages (default: the path as given).
    """
    p = Path(path)
    label = label or str(p)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise error_cls(Problem(f"cannot read file: {e.strerror or e}", source=label)) from None
    return load_yaml_text(text, label, error_cls)


def load_yaml_text(text: str, source: str = "<string>",
                   error_cls: type[ConfigError] = ConfigError) -> YamlDoc:
    """Parse one YAML document from ``text``, keeping the line of every key path."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        problems: list[Problem] = []
        lines: dict = {(): 1}
        data = _convert(loader, node, (), lines, problems, source, set()) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else None
        msg = "YAML syntax error: " + " ".join(
            s for s in (e.context, e.problem) if s)
        if mark is not None:
            msg += f" (column {mark.column + 1})"
        msg += "; fix the YAML syntax at this line (indentation, ':' after keys, quotes, brackets)"
        raise error_cls(Problem(msg, source=source, line=line)) from None
    except yaml.YAMLError as e:
        raise error_cls(Problem(f"YAML error: {e}", source=source)) from None
    finally:
        loader.dispose()
    if problems:
        raise error_cls(problems)
    return YamlDoc(data, source, lines)


def _convert(loader, node, path, lines, problems, source, active):
    import yaml

    if id(node) in active:  # a recursive alias (&a [*a]) would never end
        problems.append(Problem("recursive YAML alias is not supported", path, source,
                                node.start_mark.line + 1))
        return None
    if isinstance(node, yaml.MappingNode):
        active = active | {id(node)}
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    problems.append(Problem(
                        f"duplicate key {key!r} (first at line {seen[key]}); keep only one",
                        path + (key,), source, line))
                else:
                    seen[key] = line
            except TypeError:
                problems.append(Problem(f"mapping key {key!r} is not a plain value", path, source, line))
        loader.flatten_mapping(node)  # resolves << merge keys; explicit keys come last and win
        out: dict = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue
            sub = path + (key,)
            lines[sub] = key_node.start_mark.line + 1
            out[key] = _convert(loader, value_node, sub, lines, problems, source, active)
        return out
    if isinstance(node, yaml.SequenceNode):
        active = active | {id(node)}
        items = []
        for i, item in enumerate(node.value):
            sub = path + (i,)
            lines[sub] = item.start_mark.line + 1
            items.append(_convert(loader, item, sub, lines, problems, source, active))
        return items
    return loader.construct_object(node, deep=True)
