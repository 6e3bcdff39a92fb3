"""examples/bev: the multi-camera renderer puts a ground point where a float64 pinhole projection
says, scenes are a pure function of their arguments, the scores match an independent count, and
the BEV model (grid_sample image-to-BEV) prepares, calibrates, takes a QAT step, exports, and
runs on dal.npu equal to dal.convert on every element."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "bev"))
sys.path.insert(0, str(ROOT / "tests" / "convert"))

import bev_scenes as bs  # noqa: E402
from bev_model import GridSampleBEV, bev_metrics  # noqa: E402
from bev_deform import DeformBEV  # noqa: E402
from bev_splat import LiftSplatBEV, splat_index  # noqa: E402
from convert_common import assert_bit_exact  # noqa: E402

import dal  # noqa: E402
import dal.npu  # noqa: E402


def _pinhole(k: int, P: np.ndarray) -> np.ndarray:
    """(u, v) of world point P in camera k, float64, written out from the camera's pose: the
    oracle for the renderer (which goes through the inverse homography and grid_sample)."""
    cam = bs.camera(k)
    x, y, z = cam.R @ (P - cam.C)
    return np.array([bs.FOCAL * x / z + bs.IMAGE / 2, bs.FOCAL * y / z + bs.IMAGE / 2])


def test_camera_pose_is_the_documented_one():
    """Camera 0 stands at (0, -DISTANCE, HEIGHT), looks at (0, -LOOK, 0), image rows go down
    the world's vertical; every camera is a rotation of it about the Z axis by 90 k degrees."""
    cam = bs.camera(0)
    np.testing.assert_allclose(cam.C, [0, -bs.DISTANCE, bs.HEIGHT], atol=1e-12)
    fwd = np.array([0, bs.DISTANCE - bs.LOOK, -bs.HEIGHT]) / np.hypot(bs.DISTANCE - bs.LOOK, bs.HEIGHT)
    np.testing.assert_allclose(cam.R[2], fwd, atol=1e-12)
    np.testing.assert_allclose(cam.R @ cam.R.T, np.eye(3), atol=1e-12)
    assert cam.R[1, 2] < 0  # image "down" points down in the world
    for k in range(1, bs.CAMERAS):
        a = np.pi / 2 * k
        rot = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
        np.testing.assert_allclose(bs.camera(k).C, rot @ cam.C, atol=1e-9)


@pytest.mark.parametrize("point", [(-6.0, -9.5), (3.25, 2.0), (10.5, -1.75)])
def test_a_ground_point_lands_where_the_projection_says(point):
    """A 4 x 4-texel (1 m) bright square centred on ground point P, rendered with 8 x 8 rays per
    pixel: in every camera that sees it, the intensity centroid of the image is the pinhole
    projection of P within 0.15 pixel (pixel (v, u) covers [u, u + 1): its centre is u + 0.5;
    a half-pixel slip in either convention is 0.5). The rest is the perspective's own bias (the
    centroid of a square's image is not the image of its centre) and sampling: 0.10 at most
    over 20 views measured."""
    X, Y = point
    tex = torch.zeros(1, 1, bs.TEXELS, bs.TEXELS)
    c, r = int((X + bs.EXTENT) * 4), int((Y + bs.EXTENT) * 4)  # the texel whose corner is P
    tex[0, 0, r - 2:r + 2, c - 2:c + 2] = 1.0
    images = bs.render(tex, supersample=8)[0].double().numpy()
    seen = 0
    for k in range(bs.CAMERAS):
        u, v = _pinhole(k, np.array([X, Y, 0.0]))
        if not (3 <= u < bs.IMAGE - 3 and 3 <= v < bs.IMAGE - 3):
            continue  # near an edge or outside: the square may be cut
        seen += 1
        img = images[k]
        assert img.sum() > 0, f"camera {k} shows nothing where ({X}, {Y}) projects: ({u:.2f}, {v:.2f})"
        rows, cols = np.mgrid[0:bs.IMAGE, 0:bs.IMAGE]
        cu = (img * (cols + 0.5)).sum() / img.sum()
        cv = (img * (rows + 0.5)).sum() / img.sum()
        assert abs(cu - u) < 0.15 and abs(cv - v) < 0.15, (k, (cu, cv), (u, v))
    assert seen >= 2


def test_reference_grid_is_the_projection_of_the_cell_centres():
    """grid_sample coordinates (align_corners=False) of BEV cell (i, j) in camera k are
    2 (u, v) / IMAGE - 1 of its centre's projection; every cell is seen by at least 2 cameras."""
    grid, seen = bs.reference_grids()
    assert int(seen.sum(0).min()) >= 2
    for k, i, j in [(0, 0, 16), (1, 20, 30), (2, 31, 5), (3, 12, 1)]:
        P = np.array([-bs.EXTENT + j + 0.5, -bs.EXTENT + i + 0.5, 0.0])
        u, v = _pinhole(k, P)
        if seen[k, i, j]:
            np.testing.assert_allclose(grid[k, i, j].double().numpy(), [2 * u / bs.IMAGE - 1, 2 * v / bs.IMAGE - 1],
                                       atol=1e-6)
        else:
            assert not (0 <= u < bs.IMAGE and 0 <= v < bs.IMAGE)


def test_splat_index_puts_each_feature_pixel_in_the_cell_its_ray_meets():
    """Feature pixel (y, x) of camera k (image point (2 x + 1, 2 y + 1)) goes to cell (i, j) only if
    that point lies inside the projection of the cell's four ground corners (forward pinhole
    projection, float64); a pixel sent to the spare cell lies inside no cell's projection."""
    index = splat_index().numpy().reshape(bs.CAMERAS, bs.IMAGE // 2, bs.IMAGE // 2)
    assert (index < bs.CELLS ** 2).sum() > 1000
    g = np.random.default_rng(0)

    def inside(k, i, j, pt):
        quad = [_pinhole(k, np.array([-bs.EXTENT + j + dj, -bs.EXTENT + i + di, 0.0]))
                for di, dj in ((0, 0), (0, 1), (1, 1), (1, 0))]
        edges = [(quad[(m + 1) % 4] - quad[m], pt - quad[m]) for m in range(4)]
        cross = [a[0] * b[1] - a[1] * b[0] for a, b in edges]
        return all(c >= -1e-9 for c in cross) or all(c <= 1e-9 for c in cross)

    for _ in range(40):
        k, y, x = g.integers(bs.CAMERAS), g.integers(bs.IMAGE // 2), g.integers(bs.IMAGE // 2)
        pt, e = np.array([2.0 * x + 1, 2.0 * y + 1]), int(index[k, y, x])
        if e < bs.CELLS ** 2:
            assert inside(k, e // bs.CELLS, e % bs.CELLS, pt), (k, y, x, e)
    k, y, x = 0, 0, bs.IMAGE // 4  # top row of camera 0: its ray meets the ground beyond the grid
    assert index[k, y, x] == bs.CELLS ** 2
    assert not any(inside(k, i, j, np.array([2.0 * x + 1, 1.0])) for i in range(bs.CELLS) for j in range(bs.CELLS))


def test_scenes_are_deterministic_and_targets_come_from_the_strokes():
    a, b = bs.bev_scenes("test", 6), bs.bev_scenes("test", 6)
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.images, bs.bev_scenes("train", 6).images)
    # a cell is occupied exactly where one of its 4 x 4 texels is a stroke (> 0.5)
    blocks = a.textures[:, 0].reshape(6, bs.CELLS, 4, bs.CELLS, 4).amax(dim=(2, 4))
    assert torch.equal(a.targets != 0, blocks > 0.5)


def test_metrics_match_an_independent_count():
    """bev_metrics against torchmetrics' binary Jaccard index (occupancy) and a plain count."""
    tm = pytest.importorskip("torchmetrics.functional")
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 11, (3, 32, 32), generator=g) * (torch.rand(3, 32, 32, generator=g) < 0.3)
    pred = torch.where(torch.rand(3, 32, 32, generator=g) < 0.8, target, torch.randint(0, 11, (3, 32, 32), generator=g))
    got = bev_metrics(pred, target)
    occ = tm.jaccard_index((pred != 0).int(), (target != 0).int(), task="binary")
    free = tm.jaccard_index((pred == 0).int(), (target == 0).int(), task="binary")
    assert got["miou"] == pytest.approx(50 * float(occ + free), abs=1e-4)
    t, p = target.flatten().tolist(), pred.flatten().tolist()
    occupied = [(a, b) for a, b in zip(t, p) if a != 0]
    assert got["class_acc"] == pytest.approx(100 * sum(a == b for a, b in occupied) / len(occupied))


def test_lift_splat_variant_exports_and_npu_equals_integer_model():
    """The scatter-add variant, scatter_add quantized by a rule added to int8_balanced: the export
    holds a ScatterElements with reduction add, and dal.npu == dal.convert on every element."""
    torch.manual_seed(0)
    scenes = bs.bev_scenes("train", 8)
    net = LiftSplatBEV(width=8, head=8)
    with torch.no_grad():
        net.train()(scenes.images)
    recipe = {"name": "int8_balanced_scatter", "rules": [
        {"type": ["conv", "linear"], "weight": {"format": "int8", "granularity": "per_channel", "symmetric": True},
         "input": {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}},
        {"type": ["add", "mul", "activation", "scatter_add"],
         "input": {"format": "uint8", "granularity": "per_tensor", "symmetric": False, "observer": "minmax"}}]}
    p = dal.prepare_qat(net, recipe=recipe, hardware="a2000", example_inputs=(scenes.images[:2],))
    dal.calibrate(p, [scenes.images[:4], scenes.images[4:]], progress=False)
    dal.set_quantizer_state(p, "frozen")
    proto = dal.export_onnx(p.eval(), (scenes.images[:2],))
    sc = [n for n in proto.graph.node if n.op_type == "ScatterElements"]
    assert len(sc) == 1 and any(a.name == "reduction" and a.s == b"add" for a in sc[0].attribute)
    assert_bit_exact(dal.convert(p), proto, dal.npu.load(proto, threads=1), [scenes.images[:2]], "splat")


def test_deformable_variant_is_recognised_and_npu_equals_integer_model():
    """The MSDA variant under int8_balanced: prepare finds the deformable attention (its sampling
    arithmetic and weighted sum get int16 quantizers, besides the grid_samples' fixed int16 grids),
    and the export runs on dal.npu equal to dal.convert on every element."""
    from dal.nn.grid_sample import GridQuantizer
    from dal.quantizer import FakeQuantizer

    torch.manual_seed(0)
    scenes = bs.bev_scenes("train", 8)
    net = DeformBEV(width=8, head=8)
    with torch.no_grad():
        net.train()(scenes.images)
    p = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(scenes.images[:2],))
    int16 = [m for m in p.modules() if isinstance(m, FakeQuantizer) and not isinstance(m, GridQuantizer)
             and m.fmt.name == "int16"]
    assert int16, "no int16 quantizer outside the grids: the deformable attention was not recognised"
    dal.calibrate(p, [scenes.images[:4], scenes.images[4:]], progress=False)
    dal.set_quantizer_state(p, "frozen")
    proto = dal.export_onnx(p.eval(), (scenes.images[:2],))
    assert sum(n.op_type == "GridSample" for n in proto.graph.node) == 1 + bs.CAMERAS
    assert_bit_exact(dal.convert(p), proto, dal.npu.load(proto, threads=1), [scenes.images[:2]], "deform")


@pytest.fixture(scope="module")
def exported():
    torch.manual_seed(0)
    scenes = bs.bev_scenes("train", 12)
    net = GridSampleBEV(width=16, head=16)
    with torch.no_grad():
        net.train()(scenes.images)  # BatchNorm running statistics from data, as a trained model has
    p = dal.prepare_qat(net, recipe="int8_balanced", hardware="a2000", example_inputs=(scenes.images[:2],))
    dal.calibrate(p, [scenes.images[:4], scenes.images[4:8]], progress=False)
    return p, scenes


def test_qat_step_export_and_npu_equals_integer_model(exported):
    """One QAT step moves the weights with finite gradients; the export holds a GridSample whose
    grid is int16 codes at scale 2^-14; dal.npu (from the file) == dal.convert (from the model) on
    every output element and every quantized tensor, on two batches."""
    p, scenes = exported
    p.train()
    opt = torch.optim.SGD(p.parameters(), lr=0.01)
    params = [q for q in p.parameters() if q.requires_grad]
    before = [q.detach().clone() for q in params]
    loss = torch.nn.functional.cross_entropy(p(scenes.images[8:12]), scenes.targets[8:12])
    loss.backward()
    assert all(q.grad is not None and torch.isfinite(q.grad).all() for q in params)
    opt.step()
    assert sum(not torch.equal(a, q) for a, q in zip(before, params)) >= len(params) // 2
    dal.set_quantizer_state(p, "frozen")
    p.eval()
    proto = dal.export_onnx(p, (scenes.images[:2],))
    gs = [n for n in proto.graph.node if n.op_type == "GridSample"]
    assert len(gs) == 1
    made = {o: n for n in proto.graph.node for o in n.output}
    inits = {t.name: t for t in proto.graph.initializer}
    grid_dq = made[gs[0].input[1]]
    assert grid_dq.op_type == "DequantizeLinear"
    zp = grid_dq.input[2] if grid_dq.input[2] in inits else made[grid_dq.input[2]].input[0]
    assert zp not in inits or inits[zp].data_type == TensorProto.INT16
    sess = dal.npu.load(proto, threads=1)
    assert_bit_exact(dal.convert(p), proto, sess, [scenes.images[:2], scenes.images[2:4]], "bev")


@pytest.mark.parametrize("marker, result", [("bev-table", "bev.md"), ("bev-splat-table", "bev_splat.md"),
                                            ("bev-deform-table", "bev_deform.md")])
def test_readme_bev_table_is_the_benchmark_output(marker, result):
    """README's BEV tables are the ones bench/bev.py wrote to bench/results/."""
    import re

    readme = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- {marker} -->\n(.*?)<!-- /{marker} -->", readme, flags=re.S)
    assert found, f"README.md has no <!-- {marker} --> block"
    table = found.group(1).strip()
    assert table.startswith("| model |")
    assert table in (ROOT / "bench" / "results" / result).read_text(), \
        f"README's {marker} differs from bench/results/{result}: re-run bench/bev.py --write"
