"""A module whose forward never runs on the example inputs (its parent computes with its weight)
stays float, decided before apply from the float forward (dal.prepare.example_run): prepare never
builds its QAT module, and a QAT module already in the model is given back as float by apply."""
import torch
from torch import nn

import dal
from dal.nn.base import QATModule
from parent_reads_weight import ReadsWeight


def test_a_planned_layer_that_never_runs_is_never_built(monkeypatch):
    import dal.prepare.apply as apply

    built = []
    real = apply._leaf_module
    monkeypatch.setattr(apply, "_leaf_module", lambda mod, step: built.append(step.path) or real(mod, step))
    m = ReadsWeight()
    fc = m.fc
    q = dal.prepare_qat(m, "int8_balanced", hardware="a2000", example_inputs=(torch.randn(4, 8),))
    assert built == ["out"] and q.fc is fc
    row = next(r for r in dal.prepared(q).report.rows if r.name == "fc")
    assert (row.type_name, row.status) == ("Linear", "float") and "never runs" in row.detail


def test_a_qat_module_already_in_the_model_that_never_runs_is_given_back_as_float():
    x = torch.randn(4, 8)
    first = dal.prepare_qat(ReadsWeight(), "int8_balanced", hardware="a2000")  # no example inputs: fc is QLinear
    assert isinstance(first.fc, QATModule)
    weight = first.fc.weight
    again = dal.prepare_qat(first, "int8_balanced", hardware="a2000", example_inputs=(x,))
    assert type(again.fc) is nn.Linear and again.fc.weight is weight
    assert next(r for r in dal.prepared(again).report.rows if r.name == "fc").status == "float"
