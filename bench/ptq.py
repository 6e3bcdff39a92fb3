"""Time of each dal.ptq step on ResNet-18 (random weights, 256 calibration images at 224x224),
next to torch.ao's eager PTQ of the same model on the same images (measured in the same run),
and dal.auto_quantize end to end on the MNIST CNN.

    python bench/ptq.py                # writes bench/results/ptq.md
    python bench/ptq.py --images 32    # smoke run
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import dal
from dal import ptq

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from lowbit import cpu_flags  # noqa: E402


def timed(rows, name, fn, note=""):
    t = time.perf_counter()
    out = fn()
    rows.append((name, time.perf_counter() - t, note))
    print(f"{name}: {rows[-1][1]:.1f} s", file=sys.stderr, flush=True)
    return out


def torch_ao_ptq(net, calib):
    """torch.ao eager PTQ: fuse conv+bn(+relu), observe the calibration images, convert."""
    from torchvision.models.quantization import resnet18 as qresnet18

    torch.backends.quantized.engine = "qnnpack"
    m = qresnet18(weights=None, quantize=False)
    m.load_state_dict(net.state_dict())
    m.eval().fuse_model()
    m.qconfig = torch.ao.quantization.get_default_qconfig("qnnpack")
    torch.ao.quantization.prepare(m, inplace=True)
    with torch.no_grad():
        for x in calib:
            m(x)
    return torch.ao.quantization.convert(m)


def resnet_rows(images: int, batch: int, iters: int) -> list:
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None).eval()
    calib = [torch.randn(batch, 3, 224, 224) for _ in range(images // batch)]
    rows: list = []
    timed(rows, "torch.ao eager PTQ (fuse + observe + convert), the peer", lambda: torch_ao_ptq(net, calib))
    work = copy.deepcopy(net)
    timed(rows, "fold_batchnorm", lambda: ptq.fold_batchnorm(work))
    timed(rows, "equalize (data-free)", lambda: ptq.equalize(work))
    ex = (calib[0][:1],)
    q = timed(rows, "prepare_qat (int8_balanced)", lambda: dal.prepare_qat(copy.deepcopy(work), recipe="int8_balanced",
                                                                          hardware="a2000", example_inputs=ex))
    timed(rows, "calibrate min-max", lambda: dal.calibrate(q, calib, progress=False, method="minmax"))
    q2 = copy.deepcopy(q)
    timed(rows, "calibrate mse", lambda: dal.calibrate(q2, calib, progress=False, method="mse"))
    timed(rows, f"adaround ({iters} steps of {min(batch, 8)} images per layer)",
          lambda: ptq.adaround(q, calib, iters=iters, batch_size=8, progress=False))
    timed(rows, "bias_correction", lambda: ptq.bias_correction(q, calib, progress=False))
    qbn = dal.prepare_qat(copy.deepcopy(net), recipe="int8_balanced", hardware="a2000", example_inputs=ex)
    dal.calibrate(qbn, calib[:1], progress=False)
    timed(rows, "reestimate_bn (BN folded in QConvBn2d)", lambda: ptq.reestimate_bn(qbn, calib, progress=False))
    return rows


def auto_rows() -> tuple:
    sys.path.insert(0, "tests")
    from mnist_helpers import trained_mnist

    net, calib, test = trained_mnist()
    from dal_examples.training import accuracy

    acc = lambda m: accuracy(m, test)  # noqa: E731
    rows: list = []
    res = {}
    for drop in (1.0, 0.0):
        res[drop] = timed(rows, f"auto_quantize MNIST CNN, w4a8_fp8_performance, max_drop {drop}",
                          lambda: dal.auto_quantize(net, calib, acc, max_drop=drop, hardware="a2000",
                                                    recipe="w4a8_fp8_performance", progress=False,
                                                    adaround_args={"iters": 300}))
    return rows, res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--iters", type=int, default=100, help="AdaRound steps per layer")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = resnet_rows(args.images, args.batch, args.iters)
    arows, res = auto_rows()
    lines = [f"CPU: {cpu_flags()}; torch {torch.__version__}, 1 thread; the machine is shared (times swing 1.5-2x)",
             "", f"ResNet-18, random weights, {args.images} calibration images 224x224 in batches of {args.batch}:", "",
             "| step | seconds |", "|---|---|"]
    lines += [f"| {n} | {s:.1f} |" for n, s, _ in rows]
    lines += ["", "dal.auto_quantize end to end on the MNIST CNN (tests/mnist_helpers.trained_mnist, 1024 test images):",
              "", "| run | seconds |", "|---|---|"]
    lines += [f"| {n} | {s:.1f} |" for n, s, _ in arows]
    for drop, r in res.items():
        lines += ["", f"max_drop {drop}:", "", "```", str(r), "```"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.images == 256:
        with open("bench/results/ptq.md", "w") as f:
            f.write("# bench/ptq.py\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
