"""Build hook: the wheel carries the bundled recipes and hardware models as package data.

The one source of truth is the repository's top-level ``recipes/*.yaml`` and
``hardware_models/*.yaml`` (where users look for them), with each folder's ``README.md`` (the
YAML schema). ``build_py`` copies them into
``dal/_bundled/<folder>/`` of the *build directory* only, so the wheel has them and the source
tree never holds a second copy; ``dal.config.bundled`` finds them there through
``importlib.resources``. An editable install copies nothing: the package then sits in the
checkout and reads the repository folders directly. Everything else is in ``pyproject.toml``.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUNDLED = ("recipes", "hardware_models")  # top-level folders -> dal/_bundled/<folder>/{*.yaml,README.md}


def bundled_sources() -> list[tuple[Path, str]]:
    """(source file, path inside the package) of every bundled YAML and each folder's README.md;
    raises if a folder has no YAML or no README."""
    out = []
    for folder in BUNDLED:
        files = sorted((ROOT / folder).glob("*.yaml"))
        readme = ROOT / folder / "README.md"
        if not files or not readme.is_file():
            raise SystemExit(f"setup.py: no {folder}/*.yaml or {folder}/README.md next to setup.py ({ROOT}); "
                             "build from a source checkout or from an sdist (MANIFEST.in includes them)")
        out += [(f, f"_bundled/{folder}/{f.name}") for f in files + [readme]]
    return out


class BuildPyWithBundled(build_py):
    """``build_py`` that also copies the bundled YAML files into ``<build_lib>/dal/_bundled``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable: dal.config.bundled falls back to the repository folders
        for src, rel in bundled_sources():
            target = Path(self.build_lib, "dal", rel)
            self.mkpath(str(target.parent))
            self.copy_file(str(src), str(target))

    def get_outputs(self, include_bytecode=True):
        extra = [] if getattr(self, "editable_mode", False) else [
            str(Path(self.build_lib, "dal", rel)) for _, rel in bundled_sources()]
        return super().get_outputs(include_bytecode) + extra


setup(cmdclass={"build_py": BuildPyWithBundled})
