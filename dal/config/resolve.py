"""One way to turn what a user passes (bundled name, path, dict, object) into a loaded config.

``load_hardware`` and ``load_recipe`` are both ``load_config(value, kind)`` with their own
``ConfigKind``: the object type that passes through, the parser of a YAML document, the
bundled folder and the words used in messages.

    >>> kind = ConfigKind(noun="recipe", arg="recipe", folder="recipes", error=ConfigError,
    ...                   type=dict, parse=lambda doc: doc.data)
    >>> load_config({"rules": []}, kind)
    {'rules': []}
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dal.config.bundled import FOLDERS, bundled_names, find_bundled, looks_like_path
from dal.config.fields import did_you_mean
from dal.config.problems import ConfigError, Problem
from dal.config.yaml_lines import YamlDoc, from_data, load_yaml_file


@dataclass(frozen=True)
class ConfigKind:
    """What ``load_config`` needs to know about one kind of configuration.

    Attributes:
        noun: what it is called in messages (``"hardware model"``).
        arg: the argument name users pass it as (``"hardware"``).
        folder: the bundled folder (``"hardware_models"``, one of ``dal.config.bundled.FOLDERS``).
        error: the ``ConfigError`` subclass raised.
        type: objects of this type are returned as they are.
        parse: ``YamlDoc -> object``; validates and raises ``error`` with located problems.
        read: ``(path, label) -> object`` for a file (default: parse the file); a kind that
            caches parsed files passes its own.
    """

    noun: str
    arg: str
    folder: str
    error: type
    type: type
    parse: Callable[[YamlDoc], Any]
    read: Callable[[Path, str], Any] | None = None

    def __post_init__(self):
        if self.folder not in FOLDERS:
            raise ValueError(f"ConfigKind.folder={self.folder!r} is not one of {', '.join(FOLDERS)}")
        if not (isinstance(self.error, type) and issubclass(self.error, ConfigError)):
            raise TypeError(f"ConfigKind.error must be a ConfigError subclass, got {self.error!r}")

    def read_file(self, path: Path, label: str):
        """Load the file at ``path``, naming it ``label`` in messages."""
        if self.read is not None:
            return self.read(path, label)
        return self.parse(load_yaml_file(path, self.error, label))


def list_bundled(kind: ConfigKind) -> list[str]:
    """Names of the bundled files of ``kind``."""
    return bundled_names(kind.folder)


def load_config(value, kind: ConfigKind):
    """``value`` as a loaded, validated object of ``kind.type``.

    - an object of ``kind.type``: returned as it is;
    - a dict: parsed as a document without lines (source ``"<dict>"``);
    - a ``Path``, or a string that looks like a path (``.yaml``/``.yml`` suffix, a directory
      separator) or names an existing file: that file, labelled by the path as given;
    - any other string: a bundled name (case-insensitive), labelled by the bundled file's own path
      (in an installed wheel ``.../site-packages/dal/_bundled/<folder>/<name>.yaml``), so that an
      error's ``file:line`` is a file the user has.

    Raises ``kind.error`` for a missing file, an unknown bundled name (listing the bundled
    names and the closest one) or a value of another type.
    """
    if isinstance(value, kind.type):
        return value
    if isinstance(value, dict):
        return kind.parse(from_data(value, "<dict>"))
    if isinstance(value, str) and ("\n" in value or len(value) > 255):
        # YAML text, not a name or a path (the file system would answer "File name too long")
        raise kind.error(Problem(
            f"{kind.arg}= got a string of {len(value)} characters that is neither a bundled name nor a file "
            f"path (it starts {value[:40]!r}); for YAML text pass yaml.safe_load(text) as a dict"))
    if isinstance(value, (str, Path)):
        path, label = resolve_path(value, kind)
        return kind.read_file(path, label)
    raise kind.error(Problem(
        f"{kind.arg}={value!r} ({type(value).__name__}) is not a {kind.noun}; pass a bundled name "
        f"({', '.join(list_bundled(kind))}), a YAML path, a dict or a {kind.type.__name__}"))


def resolve_path(spec: "str | Path", kind: ConfigKind) -> tuple[Path, str]:
    """(path, label for messages) of a file path or bundled name; see ``load_config``."""
    if isinstance(spec, Path) or looks_like_path(spec) or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise kind.error(Problem(f"{kind.noun} file {str(path)!r} does not exist", source=str(path)))
        return path, str(path)
    found = find_bundled(kind.folder, spec)
    if found is None:
        names = list_bundled(kind)
        raise kind.error(Problem(
            f"{kind.arg}={spec!r} is not a bundled {kind.noun}{did_you_mean(spec.lower(), names)} "
            f"(bundled: {', '.join(names) or '(none found)'}); or pass a path to a YAML file"))
    return found, str(found)  # the file itself (in a wheel: site-packages/dal/_bundled/...): one a user can open
