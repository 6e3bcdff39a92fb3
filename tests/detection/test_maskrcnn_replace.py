"""Mask R-CNN prepared with a recipe that has a ``replace:`` list trains (issue 41, capture defect 3).

The ``conv_bn_relu`` rule reads every module's own forward with torch.fx. torchvision's
``MultiScaleRoIAlign`` caches ``self.scales`` / ``self.map_levels`` on its first call, so the
trace left fx Proxies there, and the first training step failed with "Proxy object cannot be
iterated". The model here is torchvision's ``MaskRCNN`` class with its own ResNet-18 FPN
backbone (the ROI heads, where the defect lies, are those of ``maskrcnn_resnet50_fpn``), random
weights, 96-pixel images, one step with the model's own losses."""
import copy

import pytest
import torch
import torch.fx as fx

import dal
from dal.nn.own_forward import trace_own_forward
from dal.recipe import load_recipe

torchvision = pytest.importorskip("torchvision")
from torchvision.models.detection import MaskRCNN  # noqa: E402
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone  # noqa: E402
from torchvision.ops import MultiScaleRoIAlign  # noqa: E402

SIZE = 96


def _proxies(model: torch.nn.Module) -> list[str]:
    """``path.attr`` of every fx Proxy held in a module's plain attributes (lists / tuples too)."""
    found = []
    for path, mod in model.named_modules():
        for key, value in vars(mod).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, fx.Proxy) for v in values):
                found.append(f"{path}.{key}")
    return found


def test_tracing_a_forward_that_caches_on_itself_leaves_no_proxy():
    pool = MultiScaleRoIAlign(["0", "1"], 7, 2)
    before = dict(vars(pool))
    trace_own_forward(pool)  # its forward sets self.scales from the (Proxy) features while tracing
    assert pool.scales is None and pool.map_levels is None
    assert vars(pool).keys() == before.keys()


@pytest.fixture(scope="module")
def maskrcnn():
    torch.manual_seed(0)
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5,
                                   norm_layer=torch.nn.BatchNorm2d)  # as maskrcnn_resnet50_fpn(weights=None)
    return MaskRCNN(backbone, num_classes=3, min_size=SIZE, max_size=SIZE)


def test_maskrcnn_with_a_replace_list_trains(maskrcnn):
    recipe = {**load_recipe("int8_balanced").to_dict(), "replace": ["conv_bn_relu"]}
    model = dal.prepare_qat(copy.deepcopy(maskrcnn), recipe=recipe, hardware="a2000")
    report = dal.prepared(model).report
    assert any("conv_bn_relu" in n for n in report.notes)  # the rule ran over the model
    assert not _proxies(model)  # the rule's fx traces left nothing behind
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, SIZE, SIZE, generator=g) for _ in range(2)]
    model.eval()
    with torch.no_grad():
        dal.calibrate(model, [model.transform(images)[0].tensors])
    masks = torch.zeros(1, SIZE, SIZE, dtype=torch.uint8)
    masks[:, 10:50, 8:60] = 1
    targets = [{"boxes": torch.tensor([[8.0, 10.0, 60.0, 50.0]]), "labels": torch.tensor([1]), "masks": masks}] * 2
    model.train()
    losses = model(images, targets)
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    loss = sum(losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    mask_conv = next(m for n, m in model.named_modules() if n.startswith("roi_heads.mask_head") and hasattr(m, "weight"))
    assert mask_conv.weight.grad is not None and torch.isfinite(mask_conv.weight.grad).all()
    assert not _proxies(model)

