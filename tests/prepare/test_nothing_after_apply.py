"""prepare is plan -> check -> apply, and nothing is installed after apply (issue 41, item 3).

``dal.prepare.api.apply_plan`` is wrapped here to snapshot the model it returns: every module
under every name (object, type), its forward hooks and pre-hooks (the hook objects), its
parameters (object, ``requires_grad``) and buffers (object), and its plain attributes with their
values where they are numbers, strings or None (a quantizer's state, its power-of-two rounding).
The model ``prepare_qat`` returns must equal that snapshot, except the one attribute that
carries the plan and the report (``dal.prepared``). The cases exercise each model-wide action:
output quantizers, a module whose forward never runs, 2:4 sparsity, shared scales and
power-of-two scales, scales-only freezing, and a detector's argument guard.
"""
import pytest
import torch
from torch import nn

import dal
import dal.prepare.api as api
from dal.prepare.handle import ATTR
from dal_examples.zoo import MnistCNN
from parent_reads_weight import ReadsWeight


_PLAIN = (bool, int, float, str, type(None))


def snapshot(model: nn.Module) -> dict:
    """Everything apply may install, by module path (module doc)."""
    out = {}
    for path, m in model.named_modules(remove_duplicate=False):
        out[path] = (id(m), type(m),
                     tuple(id(h) for h in m._forward_pre_hooks.values()),
                     tuple(id(h) for h in m._forward_hooks.values()),
                     tuple((k, id(p), p.requires_grad) for k, p in m._parameters.items() if p is not None),
                     tuple((k, id(b)) for k, b in m._buffers.items() if b is not None),
                     tuple(sorted((k, v if isinstance(v, _PLAIN) else type(v).__name__)
                                  for k, v in vars(m).items() if k != ATTR and not k.startswith("_"))))
    return out


class CatNet(nn.Module):
    """Two convs concatenated: a concat the pow2_int8 hardware runs without requantizing."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c(torch.cat([torch.relu(self.a(x)), self.b(x)], 1))


def _fcos():
    from torchvision.models import detection

    return detection.fcos_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3, min_size=64, max_size=64)


CASES = {  # name -> (model, recipe, hardware, example inputs, prepare_qat keywords)
    "outputs+never-runs": (ReadsWeight, "int8_balanced", "a2000", lambda: (torch.randn(4, 8),),
                           {"quantize_outputs": True}),
    "sparsity": (MnistCNN, "int8_sparse24", "a2000", lambda: (torch.randn(2, 1, 28, 28),), {}),
    "shared-scale+pow2": (CatNet, "int8_balanced", "pow2_int8", lambda: (torch.randn(2, 3, 8, 8),),
                          {"quantize_outputs": True}),
    "scales-only": (MnistCNN, "w4a8_lsq_scales_only", "a2000", lambda: (torch.randn(2, 1, 28, 28),), {}),
    "detector-guard": (_fcos, "int8_balanced", "a2000", lambda: ([torch.rand(3, 64, 64)],), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_model_apply_returns_is_the_prepared_model(name, monkeypatch):
    make, recipe, hardware, inputs, kw = CASES[name]
    if name == "detector-guard":
        pytest.importorskip("torchvision")
    torch.manual_seed(0)
    seen = []

    def apply_and_snapshot(*args, **kwargs):
        model = real(*args, **kwargs)
        seen.append((model, snapshot(model)))
        return model

    real = api.apply_plan
    monkeypatch.setattr(api, "apply_plan", apply_and_snapshot)
    q = dal.prepare_qat(make(), recipe, hardware=hardware, example_inputs=inputs() if inputs else None, **kw)
    (applied, before), = seen
    assert q is applied
    after = snapshot(q)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"changed after apply: {changed[:5]}: {[(before.get(p), after.get(p)) for p in changed[:2]]}"
    handle = dal.prepared(q)
    # what each action did is on the model apply returned (so the snapshot compared covers it)
    if name == "outputs+never-runs":
        assert type(q.fc) is nn.Linear and q.out.output_quant is not None
        assert next(r for r in handle.report.rows if r.name == "fc").status == "float"
    if name == "sparsity":
        assert getattr(q.head, "weight_mask", None) is not None
    if name == "shared-scale+pow2":
        cat = next(m for m in q.modules() if type(m).__name__ == "QCat")
        assert cat.input_quants[0] is cat.input_quants[1] is cat.output_quant
    if name == "scales-only":
        assert not q.head.weight.requires_grad
    if name == "detector-guard":
        with pytest.raises(ValueError, match=r"detector images\[0\]: expected a \(3, H, W\) tensor"):
            q([torch.rand(64, 64)])
