"""The wheel carries its data: built, installed into a fresh venv, used from another folder.
The examples the README uses (dal_examples, examples/) are a second wheel installed beside it.

The sdist is built from a copy of the project's files, the wheel from that sdist (so
MANIFEST.in and setup.py's build hook are both exercised), without build isolation or the
network. The fresh venv reuses the main venv's pinned torch etc. through a ``.pth`` line (site
packages added that way have their own ``.pth`` files ignored, so the main venv's *editable*
dal is not importable from it); the test asserts that ``dal`` is imported from the fresh venv.
The oracles are the repository itself: the bundled YAML must equal the top-level files byte
for byte, and every README block must run as written, from another folder, on the installed
wheel (the NPU library's build cache is keyed by its sources' content, so the wheel's byte-equal
sources reuse a build the suite already made).
"""
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from test_readme import README

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "CHANGELOG.md", "dal", "recipes",
                 "hardware_models")
BUNDLED = ("recipes", "hardware_models")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("wheel")]  # one build, on one worker


def run(cmd, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def repo_digests() -> dict:
    """Every bundled file (each folder's YAML and its README.md, the schema) -> its SHA-256."""
    return {f"{folder}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in BUNDLED for p in sorted((ROOT / folder).glob("*.yaml")) + [ROOT / folder / "README.md"]}


def quickstart_block() -> str:
    """The first python block of the README's Quickstart section."""
    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def z_read(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.so", "_bundled", "*.egg-info")
    for name in PROJECT_FILES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    py = sys.executable
    run([py, "-c", "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))",
         tmp / "sdist"], cwd=src, env=clean_env())
    (sdist,) = (tmp / "sdist").glob("dal-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    for key in repo_digests():
        assert any(n.endswith("/" + key) for n in names), f"the sdist lacks {key} (MANIFEST.in)"
    run([py, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
         "-w", tmp / "dist", sdist], cwd=tmp, env=clean_env())
    (whl,) = (tmp / "dist").glob("dal-*.whl")
    return whl


@pytest.fixture(scope="module")
def examples_wheel(tmp_path_factory) -> Path:
    """The separate dal_examples package (examples/pyproject.toml), built from a copy of examples/."""
    tmp = tmp_path_factory.mktemp("examples-wheel")
    shutil.copytree(ROOT / "examples", tmp / "examples",
                    ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info", "build"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
         "-w", tmp / "dist", tmp / "examples"], cwd=tmp, env=clean_env())
    (whl,) = (tmp / "dist").glob("dal_examples-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv_python(wheel, examples_wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    # Install before the main venv is visible, so pip sees (and would touch) nothing else.
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--no-cache-dir", "--ignore-installed", "--no-warn-script-location", wheel, examples_wheel], env=clean_env())
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).strip()
    (Path(site) / "_main_venv_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def test_wheel_holds_the_bundled_files_and_declares_its_dependencies(wheel):
    with zipfile.ZipFile(wheel) as z:
        digests = {n.split("dal/_bundled/", 1)[1]: hashlib.sha256(z.read(n)).hexdigest()
                   for n in z.namelist() if n.startswith("dal/_bundled/")}
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        names = z.namelist()
    assert digests == repo_digests()  # every bundled file, each identical to its one source
    assert "dal/npu/csrc/module.cpp" in names and "dal/formats/csrc/fake_quant.cpp" in names
    assert {"dal/_bundled/recipes/README.md", "dal/_bundled/hardware_models/README.md"} <= set(names)
    assert "dal/py.typed" in names  # PEP 561: type checkers use dal's annotations
    (license_file,) = [n for n in names if re.fullmatch(r"dal-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
    assert z_read(wheel, license_file) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in z_read(wheel, license_file) and b"Version 2.0, January 2004" in z_read(wheel, license_file)
    assert not any(n.startswith(("tests/", "recipes/", "hardware_models/")) for n in names)
    # the examples are their own package (examples/dal_examples), not dal's
    moved = [f"dal/{m}" for m in ("datasets/", "zoo_detection/", "zoo.py", "demo.py", "training.py")]
    assert not any(n.startswith(("dal_examples/", "examples/", *moved)) for n in names)
    assert re.search(r"^License-Expression: Apache-2\.0$", meta, flags=re.M)
    assert re.search(r"^Requires-Dist: ninja\b", meta, flags=re.M)
    extras = set(re.findall(r"^Provides-Extra: (\S+)", meta, flags=re.M))
    assert {"report", "ort", "lightning", "all", "dev"} <= extras


def test_installed_wheel_loads_bundled_configs_and_runs_the_quickstart(venv_python, tmp_path):
    (tmp_path / "quickstart.py").write_text(quickstart_block())
    (tmp_path / "check.py").write_text(textwrap.dedent("""\
        import hashlib, json, sys
        import onnx
        import dal
        from dal.config import bundled_dirs
        from dal.hardware import load_hardware
        from dal.recipe import load_recipe

        recipe, hw = load_recipe("int8_balanced"), load_hardware("a2000")
        ns = {}
        exec(compile(open("quickstart.py").read(), "README.md Quickstart", "exec"), ns)
        dal.set_quantizer_state(ns["model"], "frozen")
        dal.export_onnx(ns["model"], (ns["x"],), "quickstart.onnx")
        graph = onnx.load("quickstart.onnx")
        onnx.checker.check_model(graph, full_check=True)
        print(json.dumps({
            "dal": dal.__file__, "prefix": sys.prefix,
            "names": [recipe.name, hw.name, recipe.source, hw.source],
            "digests": {f"{d.name}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
                        for folder in ("recipes", "hardware_models") for d in bundled_dirs(folder)
                        for p in sorted(d.glob("*.yaml")) + [d / "README.md"]},
            "dirs": [str(d) for folder in ("recipes", "hardware_models") for d in bundled_dirs(folder)],
            "ops": sorted({n.op_type for n in graph.graph.node}),
        }))
        """))
    out = run([venv_python, "check.py"], cwd=tmp_path, env=clean_env())
    got = json.loads(out.strip().splitlines()[-1])
    prefix = Path(got["prefix"]).resolve()
    assert prefix == venv_python.parent.parent.resolve()
    assert Path(got["dal"]).resolve().is_relative_to(prefix), f"imported {got['dal']}, not the wheel"
    assert all(Path(d).resolve().is_relative_to(prefix) for d in got["dirs"]), got["dirs"]
    assert got["names"][:2] == ["int8_balanced", "a2000"]
    for source, rel in zip(got["names"][2:], ("recipes/int8_balanced.yaml", "hardware_models/a2000.yaml")):
        # errors cite this file: it must be the installed one, a path a pip user can open
        assert Path(source).resolve() == Path(got["dal"]).resolve().parent / "_bundled" / rel, source
    assert got["digests"] == repo_digests()
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= set(got["ops"])


def test_every_readme_block_runs_from_another_folder_on_the_installed_wheel(venv_python, tmp_path):
    """Each ```python block as its own script, in order, then each `dal ...` line of the ```bash
    blocks through the installed console script; all in one scratch folder (later blocks and
    commands read the files earlier ones wrote), none in the checkout."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_block_{i}.py"
        script.write_text(block)
        run([venv_python, script], cwd=tmp_path, env=clean_env())
    commands = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in block.splitlines() if line.strip().startswith("dal ")]
    assert commands, "README shows no dal command"
    for cmd in commands:
        run([venv_python.parent / "dal", *shlex.split(cmd)[1:]], cwd=tmp_path, env=clean_env())


def test_examples_wheel_holds_only_dal_examples_and_its_demo_runs_from_it(examples_wheel, venv_python, tmp_path):
    with zipfile.ZipFile(examples_wheel) as z:
        names = [n for n in z.namelist() if ".dist-info/" not in n]
    assert "dal_examples/demo.py" in names and "dal_examples/zoo_detection/train.py" in names
    assert all(n.startswith("dal_examples/") for n in names), names
    usage = run([venv_python, "-m", "dal_examples.demo", "--help"], cwd=tmp_path, env=clean_env())
    assert usage.startswith("usage: python -m dal_examples.demo")


def test_console_script_is_installed(venv_python, tmp_path):
    script = venv_python.parent / "dal"
    assert "usage: dal" in run([script, "--help"], cwd=tmp_path, env=clean_env())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert run([venv_python, "-m", "dal", "--version"], cwd=tmp_path, env=clean_env()).strip() == f"dal {version}"
