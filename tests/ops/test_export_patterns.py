"""Every export pattern the op registry declares is run by dal.npu and stated in export/SPEC.md.

An Op's ``onnx`` lists the ONNX node types its export pattern emits besides Q / DQ, and its
``spec`` the export/SPEC.md section that states them. The oracles are dal.npu's own kernel table
(``dal.npu.op_table.op_types``: the node types a dal.npu Session runs; it refuses any other) and
the text of export/SPEC.md, neither written from the registry.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import dal
from dal.npu.op_table import op_types
from dal.ops import Op

SPEC = Path(__file__).resolve().parents[2] / "export" / "SPEC.md"


def spec_sections(text: str) -> dict[str, str]:
    """``"§5b"`` -> the text of the section headed ``## 5b. ...`` (or ``### 6a. ...``), from its
    heading to the next heading of any level."""
    parts = re.split(r"(?m)^(?=#{2,4} )", text)
    out = {}
    for part in parts:
        m = re.match(r"#{2,4} (\d+[a-z]?)\.\s", part)
        if m:
            out["§" + m.group(1)] = part
    return out


def mentions(section: str, node_type: str) -> bool:
    """Does ``section`` name ONNX node type ``node_type`` as a word (``Gather`` is not found in
    ``GatherElements``)?"""
    return re.search(rf"(?<![A-Za-z]){re.escape(node_type)}(?![A-Za-z])", section) is not None


def pattern_problems(ops, npu_types, sections) -> list[str]:
    """Every way ``ops`` break the rule: a node type dal.npu does not run, an export pattern with
    no section, a section SPEC.md lacks, a section that does not name one of the op's node types."""
    bad = []
    for op in ops:
        for t in op.onnx:
            if t not in npu_types:
                bad.append(f"{op.name}: ONNX node type {t!r} has no dal.npu implementation")
        if op.onnx and not op.spec:
            bad.append(f"{op.name}: exports {op.onnx} but names no export/SPEC.md section (spec='')")
        if not op.spec:
            continue
        if op.spec not in sections:
            bad.append(f"{op.name}: spec={op.spec!r} is not a section of export/SPEC.md")
            continue
        for t in op.onnx:
            if not mentions(sections[op.spec], t):
                bad.append(f"{op.name}: export/SPEC.md {op.spec} does not mention {t}")
    return bad


@pytest.fixture(scope="module")
def npu_types():
    return op_types()


@pytest.fixture(scope="module")
def sections():
    return spec_sections(SPEC.read_text())


def test_the_oracles_are_what_they_claim(npu_types, sections):
    # dal.npu runs the node types of a QDQ Conv and refuses others (its Session says so by op type)
    assert {"Conv", "QuantizeLinear", "DequantizeLinear", "GridSample", "ScatterElements"} <= npu_types
    assert "NonMaxSuppression" not in npu_types and "Constant" not in npu_types
    assert {"§2", "§5a", "§5b", "§6", "§6a"} <= set(sections)
    assert mentions(sections["§5b"], "GridSample") and not mentions(sections["§5d"], "GatherND")


def test_every_export_node_type_runs_on_dal_npu(npu_types):
    missing = [f"{op.name}: {t}" for op in dal.ops.all_ops() for t in op.onnx if t not in npu_types]
    assert not missing, "node types no dal.npu kernel implements:\n" + "\n".join(missing)


def test_every_export_pattern_is_stated_in_spec(npu_types, sections):
    bad = pattern_problems(dal.ops.all_ops(), npu_types, sections)
    assert not bad, "\n".join(bad)


def test_export_patterns_are_declared():
    """The registry declares the patterns the exporter writes for its core ops (a registry with
    no ``onnx`` anywhere would pass the checks above vacuously)."""
    have = {op.name: op.onnx for op in dal.ops.all_ops()}
    for name, node in [("add", "Add"), ("mul", "Mul"), ("cat", "Concat"), ("matmul", "MatMul"),
                       ("grid_sample", "GridSample")]:
        assert node in have[name], (name, have[name])
    assert sum(bool(op.onnx) for op in dal.ops.all_ops()) >= 10


@pytest.mark.parametrize("onnx,spec,expect", [
    (("NoSuchNode",), "§5a", "'NoSuchNode' has no dal.npu implementation"),
    (("Relu",), "§99", "'§99' is not a section"),
    (("GridSample",), "§5d", "§5d does not mention GridSample"),
    (("Relu",), "", "names no export/SPEC.md section"),
])
def test_a_broken_entry_is_named(npu_types, sections, onnx, spec, expect):
    # a throw-away Op, never registered: the check names it and what is wrong with it
    bogus = Op(name="bogus_pattern", op_class="custom", handling="float", onnx=onnx, spec=spec)
    bad = pattern_problems([*dal.ops.all_ops(), bogus], npu_types, sections)
    assert any(b.startswith("bogus_pattern:") and expect in b for b in bad), bad
    fine = Op(name="fine_pattern", op_class="custom", handling="float", onnx=("Relu",), spec="§5a")
    assert pattern_problems([fine], npu_types, sections) == []
