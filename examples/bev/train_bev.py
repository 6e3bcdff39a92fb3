"""Train the multi-camera BEV model on rendered MNIST ground planes, float then QAT, export it and
check the exported file on dal.npu.

    python examples/bev/train_bev.py                          # defaults: a few minutes on 2 cores
    python examples/bev/train_bev.py --float-steps 20 --qat-steps 5 --train 256 --test 64
    python examples/bev/train_bev.py --model splat          # Lift-Splat-style scatter-add pooling
    python examples/bev/train_bev.py --model deform --recipe int8_deform_fp16   # + MSDA, kept in FP16

The flow is the user's: float training (:func:`train_steps`), ``dal.prepare_qat`` (int8_balanced on
the a2000: the grid_sample's grid in int16 with the fixed scale 2^-14, its output on its input's
scale), ``dal.calibrate``, QAT with the same loop, export, and the scores computed twice with the
same post-processing (:func:`evaluate`): from the torch model and from dal.npu running the file.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bev_model import GridSampleBEV, bev_metrics, predict  # noqa: E402
from bev_scenes import BEVScenes, bev_scenes  # noqa: E402
from bev_deform import DeformBEV  # noqa: E402
from bev_splat import LiftSplatBEV  # noqa: E402

MODELS = {"grid": GridSampleBEV, "splat": LiftSplatBEV, "deform": DeformBEV}


def batches(scenes: BEVScenes, batch_size: int, steps: int, seed: int = 0):
    """``steps`` (images, targets) batches, shuffled by a generator seeded with ``seed`` (a fresh
    permutation after each pass)."""
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        order = torch.randperm(len(scenes), generator=gen)
        for start in range(0, len(scenes) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield scenes.images[idx], scenes.targets[idx]
            done += 1
            if done == steps:
                return


def train_steps(model, scenes: BEVScenes, steps: int, lr: float = 2e-3, batch_size: int = 16, seed: int = 0) -> float:
    """``steps`` Adam steps (cosine learning rate) of per-cell cross-entropy; returns the last loss."""
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    loss = torch.zeros(())
    for images, targets in batches(scenes, batch_size, steps, seed):
        loss = F.cross_entropy(model(images), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())


def torch_runner(model) -> Callable:
    """``images -> logits`` of ``model`` in eval mode, without gradients."""
    model.eval()

    def run(images):
        with torch.no_grad():
            return model(images)
    return run


def npu_runner(path: str) -> Callable:
    """``images -> logits`` of the exported file run by dal.npu (one input, one output)."""
    import dal.npu

    sess = dal.npu.load(path)
    name = sess.input_names[0]
    return lambda images: torch.from_numpy(sess.run({name: images.numpy()})[0])


def evaluate(run: Callable, scenes: BEVScenes, batch_size: int = 64) -> dict:
    """``bev_metrics`` of ``run(images) -> logits`` over ``scenes`` (argmax per cell: the same
    post-processing for the torch model and for dal.npu)."""
    preds = [predict(run(scenes.images[i:i + batch_size])) for i in range(0, len(scenes), batch_size)]
    return bev_metrics(torch.cat(preds), scenes.targets)


def main(argv=None) -> dict:
    import dal

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=2000, help="training scenes (MNIST train digits)")
    ap.add_argument("--test", type=int, default=256, help="test scenes (MNIST test digits)")
    ap.add_argument("--float-steps", type=int, default=600)
    ap.add_argument("--qat-steps", type=int, default=200)
    ap.add_argument("--recipe", default="int8_balanced", help="a bundled recipe (for --model splat, one whose "
                    "rules quantize scatter_add: int8_balanced does)")
    ap.add_argument("--model", choices=sorted(MODELS), default="grid",
                    help="image-to-BEV: grid_sample, splat (scatter-add) or deform (grid_sample + MSDA)")
    ap.add_argument("--out", default="out", help="folder for the checkpoint and the ONNX file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    train, test = bev_scenes("train", args.train), bev_scenes("test", args.test)
    net = MODELS[args.model]()
    train_steps(net, train, args.float_steps)
    float_scores = evaluate(torch_runner(net), test)
    qat = dal.prepare_qat(copy.deepcopy(net), recipe=args.recipe, hardware="a2000", example_inputs=(test.images[:2],))
    dal.calibrate(qat, [train.images[i:i + 16] for i in range(0, min(256, len(train)), 16)], progress=False)
    train_steps(qat, train, args.qat_steps, lr=5e-4, seed=1)
    dal.set_quantizer_state(qat, "frozen")
    qat_scores = evaluate(torch_runner(qat), test)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bev_{args.model}_{args.recipe}.onnx")
    dal.save_checkpoint(qat, os.path.join(args.out, f"bev_{args.model}_{args.recipe}.pt"))
    dal.export_onnx(qat, (test.images[:2],), path, dynamic_batch=True)
    npu_scores = evaluate(npu_runner(path), test)
    fmt = lambda s: f"occupancy mIoU {s['miou']:.2f}, digit-class accuracy {s['class_acc']:.2f}"  # noqa: E731
    print(f"float: {fmt(float_scores)}\nQAT {args.recipe} (torch): {fmt(qat_scores)}\n"
          f"QAT {args.recipe} (dal.npu on {path}): {fmt(npu_scores)}\n({time.time() - t0:.0f} s)")
    return {"float": float_scores, "qat": qat_scores, "npu": npu_scores}


if __name__ == "__main__":
    main()
