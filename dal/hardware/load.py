"""``load_hardware``: a hardware model from a bundled name, a YAML path, a dict or an object."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from dal.hardware.bundled import bundled_names, find_bundled, looks_like_path
from dal.hardware.errors import HardwareModelError, Problem
from dal.hardware.fields import did_you_mean
from dal.hardware.model import HardwareModel
from dal.hardware.yaml_lines import from_data, load_yaml_file

FOLDER = "hardware_models"


def list_hardware() -> list[str]:
    """Names of the bundled hardware models (``["a1000", "a2000", "generic_int8"]``)."""
    return bundled_names(FOLDER)


def load_hardware(hardware) -> HardwareModel:
    """Return a validated ``HardwareModel``.

    ``hardware`` is a ``HardwareModel`` (returned as is), a bundled name (``"a2000"``,
    case-insensitive), a path to a YAML file (``str`` or ``Path``), or a dict in the YAML
    schema (see ``hardware_models/README.md``).

    >>> load_hardware("a1000").requantizer.kind
    'fixed_point'

    Raises ``HardwareModelError`` naming the file, line, key, bad value and what is allowed.
    """
    from dal.hardware.parse import parse_hardware

    if isinstance(hardware, HardwareModel):
        return hardware
    if isinstance(hardware, dict):
        return parse_hardware(from_data(hardware, "<dict>"))
    if isinstance(hardware, (str, Path)):
        path, label = _resolve(hardware)
        return _load_file(str(path.resolve()), path.stat().st_mtime_ns, label)
    raise HardwareModelError(Problem(
        f"hardware={hardware!r} ({type(hardware).__name__}) is not a hardware model; pass a bundled name "
        f"({', '.join(list_hardware())}), a YAML path, a dict or a HardwareModel"))


@lru_cache(maxsize=32)
def _load_file(path: str, mtime_ns: int, label: str) -> HardwareModel:
    """Parsed once per file version: models are frozen, so sharing one object is safe."""
    from dal.hardware.parse import parse_hardware

    return parse_hardware(load_yaml_file(path, HardwareModelError, label))


def _resolve(spec) -> tuple[Path, str]:
    """(path, label for messages): bundled files are labelled ``hardware_models/<name>.yaml``."""
    if isinstance(spec, Path) or looks_like_path(spec) or Path(spec).is_file():
        path = Path(spec)
        if not path.is_file():
            raise HardwareModelError(Problem(f"hardware model file {str(path)!r} does not exist", source=str(path)))
        return path, str(path)
    found = find_bundled(FOLDER, spec)
    if found is None:
        names = list_hardware()
        raise HardwareModelError(Problem(
            f"hardware={spec!r} is not a bundled hardware model{did_you_mean(spec.lower(), names)} "
            f"(bundled: {', '.join(names) or '(none found)'}); or pass a path to a YAML file"))
    return found, f"{FOLDER}/{found.name}"
