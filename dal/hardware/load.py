"""``load_hardware``: a hardware model from a bundled name, a YAML path, a dict or an object."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from dal.config.resolve import ConfigKind, list_bundled, load_config
from dal.config.yaml_lines import YamlDoc, load_yaml_file
from dal.hardware.errors import HardwareModelError
from dal.hardware.model import HardwareModel

FOLDER = "hardware_models"


def _parse(doc: YamlDoc) -> HardwareModel:
    from dal.hardware.parse import parse_hardware

    return parse_hardware(doc)


@lru_cache(maxsize=32)
def _load_file(path: str, mtime_ns: int, label: str) -> HardwareModel:
    """Parsed once per file version: models are frozen, so sharing one object is safe."""
    return _parse(load_yaml_file(path, HardwareModelError, label))


def _read(path: Path, label: str) -> HardwareModel:
    return _load_file(str(path.resolve()), path.stat().st_mtime_ns, label)


KIND = ConfigKind(noun="hardware model", arg="hardware", folder=FOLDER, error=HardwareModelError,
                  type=HardwareModel, parse=_parse, read=_read)


def list_hardware() -> list[str]:
    """Names of the bundled hardware models (``["a1000", "a2000", "generic_int8"]``)."""
    return list_bundled(KIND)


def load_hardware(hardware) -> HardwareModel:
    """Return a validated ``HardwareModel``.

    ``hardware`` is a ``HardwareModel`` (returned as is), a bundled name (``"a2000"``,
    case-insensitive), a path to a YAML file (``str`` or ``Path``), or a dict in the YAML
    schema (see ``hardware_models/README.md``). A file is parsed once per version (path and
    modification time); the model is frozen, so the same object is shared.

    >>> load_hardware("a1000").requantizer.kind
    'fixed_point'

    Raises ``HardwareModelError`` naming the file, line, key, bad value and what is allowed.
    """
    return load_config(hardware, KIND)
