"""pyproject.toml declares what the code needs: ninja, and extras whose union is ``all`` (``docs``, the
documentation site's tools, is not a feature of dal: it is in ``dev`` only; ``bench``, the peers only
bench/ measures, is in neither)."""
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the project supports 3.10

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def names(requirements) -> set[str]:
    return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
            for r in requirements}


def test_ninja_is_a_dependency():
    assert "ninja" in names(project()["dependencies"])  # torch.utils.cpp_extension builds dal.npu with it


def test_all_is_every_user_extra():
    extras = project()["optional-dependencies"]
    assert {"report", "ort", "lightning", "all", "dev"} <= set(extras)
    assert names(extras["report"]) == {"matplotlib"}
    assert names(extras["ort"]) == {"onnxruntime", "onnxscript"}
    assert names(extras["lightning"]) == {"pytorch-lightning"}
    user = set().union(*(names(v) for k, v in extras.items() if k not in ("all", "dev", "docs", "bench")))
    assert names(extras["all"]) == user
    assert user <= names(extras["dev"])  # make test runs every integration
    assert names(extras["docs"]) <= names(extras["dev"])  # and builds the docs site (tests/docs)
