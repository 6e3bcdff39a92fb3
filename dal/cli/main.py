"""Argument parsing and dispatch for ``dal``; each subcommand says what it needs in --help."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

EPILOG = """examples:
  dal inspect model.onnx                      formats per layer, sparsity, opset, metadata
  dal verify model.onnx --random-input 1,3,224,224
  dal export --model dal.zoo:MnistCNN --checkpoint qat.pt --input-shape 1,1,28,28 -o model.onnx
  dal verify model.onnx --model dal.zoo:MnistCNN --checkpoint qat.pt --random-input 8,1,28,28
  dal report --help
"""


class CliError(Exception):
    """A user mistake: printed as one line with what to do, exit status 2."""


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape; write it like 1,3,224,224") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape of positive sizes; write it like 1,3,224,224")
    return dims


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dal", description="dal: quantization-aware training for NPUs, QDQ ONNX "
                                "export and bit-exact parity checks against an NPU reference.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    ins = sub.add_parser("inspect", help="show what an exported QDQ ONNX file holds",
                         description="Print the opset, the dal metadata (recipe, hardware, requantizer), the "
                         "operator counts, and for every compute node the format and granularity of each input.")
    ins.add_argument("onnx", help="path of the .onnx file")
    ins.add_argument("--json", action="store_true", help="print plain JSON instead of a table")

    exp = sub.add_parser("export", help="export a dal checkpoint to QDQ ONNX",
                         description="Rebuild the model with --model, prepare it with the recipe stored in "
                         "--checkpoint (written by dal.save_checkpoint), load the weights and write QDQ ONNX.")
    exp.add_argument("--model", required=True, help="model factory as package.module:function, e.g. dal.zoo:MnistCNN")
    exp.add_argument("--checkpoint", required=True, help="checkpoint written by dal.save_checkpoint")
    exp.add_argument("--input-shape", required=True, type=_shape, help="example input shape, e.g. 1,3,224,224")
    exp.add_argument("-o", "--output", required=True, help="where to write the .onnx file")
    exp.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the lowest that carries the formats)")
    exp.add_argument("--dynamic-batch", action="store_true", help="make dimension 0 of inputs and outputs symbolic")

    ver = sub.add_parser("verify", help="parity of an exported file: NPU reference vs onnxruntime (and torch)",
                         description="Run the file on dal's NPU reference and on onnxruntime (optimizations "
                         "off), and on the torch model when --model and --checkpoint are given; print per output "
                         "cosine, PSNR and LSB mismatch counts, and the first layer where they diverge.")
    ver.add_argument("onnx", help="path of the .onnx file")
    src = ver.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a .npy file holding the input (one-input models)")
    src.add_argument("--random-input", type=_shape, metavar="SHAPE", help="use N(0,1) random input of this shape")
    ver.add_argument("--model", help="model factory (package.module:function) to compare with torch too")
    ver.add_argument("--checkpoint", help="dal checkpoint for --model")
    ver.add_argument("--seed", type=int, default=0, help="seed for --random-input (default 0)")
    ver.add_argument("--strict", action="store_true",
                     help="exit 1 unless parity meets the exporter's criterion: per output, NPU vs onnxruntime "
                          "(and vs torch with --model) >= 99.99%% within 1 LSB, none beyond 2; layer by layer <= 1 LSB")

    rep = sub.add_parser("report", help="HTML report: per-layer error, histograms, sensitivity, parity",
                         description="Write one self-contained HTML file; run `dal report --help` for its options.",
                         add_help=False)
    rep.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _cmd_inspect(args) -> int:
    import json

    import onnx

    from .inspect_onnx import describe, format_text

    try:
        model = onnx.load(args.onnx)
    except FileNotFoundError:
        raise CliError(f"{args.onnx}: no such file") from None
    except Exception as err:  # noqa: BLE001 - any parse failure is the user's file
        raise CliError(f"{args.onnx} is not a readable ONNX file: {err}") from None
    info = describe(model)
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def _load_model(factory, checkpoint, example):
    from ..checkpoint import load_checkpoint

    if not checkpoint:
        raise CliError("--model needs --checkpoint (a file written by dal.save_checkpoint)")
    return load_checkpoint(checkpoint, factory, example_inputs=example)


def _cmd_export(args) -> int:
    import torch

    import dal

    x = torch.randn(args.input_shape)
    model = _load_model(args.model, args.checkpoint, (x,))
    dal.export_onnx(model, (x,), args.output, opset=args.opset, dynamic_batch=args.dynamic_batch)
    print(f"wrote {args.output}")
    return 0


def _cmd_verify(args) -> int:
    import numpy as np
    import torch

    import dal

    if args.input:
        x = torch.from_numpy(np.load(args.input))
    else:
        x = torch.randn(args.random_input, generator=torch.Generator().manual_seed(args.seed))
    model = _load_model(args.model, args.checkpoint, (x,)) if args.model else None
    report = dal.verify(args.onnx, model, (x,))
    print(report)
    if args.strict and not report.meets_criterion():
        return 1
    return 0


def _cmd_report(args) -> int:
    import importlib.util

    if importlib.util.find_spec("dal.analysis") is None or importlib.util.find_spec("dal.analysis.report") is None:
        raise CliError("dal report needs dal.analysis.report, which this installation does not have")
    from ..analysis.report import main as report_main

    return int(report_main(args.rest) or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``dal`` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    handlers = {"inspect": _cmd_inspect, "export": _cmd_export, "verify": _cmd_verify, "report": _cmd_report}
    try:
        return handlers[args.command](args)
    except CliError as err:
        print(f"dal {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as err:
        print(f"dal {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
