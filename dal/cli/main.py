"""Argument parsing and dispatch for ``dal``; each subcommand says what it needs in --help.

A mistake in the arguments, a file that is not what it should be, or an error dal raises about
the user's model, recipe or hardware prints ONE line, ``dal COMMAND: error: ...``, naming the
option or file and what would work, and exits with status 2. Anything else is a bug and keeps
its traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from .args import CliError, one_line, shape
from .commands import cmd_export, cmd_inspect, cmd_report, cmd_verify
from .estimate_cmd import add_estimate, cmd_estimate

__all__ = ["main", "CliError"]

EPILOG = """examples:
  dal inspect model.onnx                      formats per layer, sparsity, opset, metadata
  dal verify model.onnx --random-input 1,3,224,224
  dal export --model dal_examples.zoo:MnistCNN --checkpoint qat.pt --input-shape 1,1,28,28 -o model.onnx
  dal verify model.onnx --model dal_examples.zoo:MnistCNN --checkpoint qat.pt --random-input 8,1,28,28
  dal report --model dal_examples.zoo:MnistCNN --checkpoint qat.pt --random-input 8,1,28,28 --out report.html
  dal estimate model.onnx                     estimated latency per layer / engine (hardware cost model)
"""

MODEL_HELP = ("model factory as package.module:function returning the float model, e.g. dal_examples.zoo:MnistCNN "
              "or torchvision.models:resnet18")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (with where to read more) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` on stderr and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_export(sub) -> None:
    exp = sub.add_parser("export", help="export a dal checkpoint to QDQ ONNX",
                         description="Rebuild the model with --model, prepare it with the recipe stored in "
                         "--checkpoint (written by dal.save_checkpoint), load the weights and write QDQ ONNX.")
    exp.add_argument("--model", required=True, help=MODEL_HELP)
    exp.add_argument("--checkpoint", required=True, help="checkpoint written by dal.save_checkpoint")
    exp.add_argument("--input-shape", required=True, type=shape, help="example input shape, e.g. 1,3,224,224")
    exp.add_argument("-o", "--output", required=True, help="where to write the .onnx file")
    exp.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the lowest that carries the formats)")
    exp.add_argument("--dynamic-batch", action="store_true", help="make dimension 0 of inputs and outputs symbolic")


def _add_verify(sub) -> None:
    ver = sub.add_parser("verify", help="parity of an exported file: NPU reference vs onnxruntime (and torch)",
                         description="Run the file on dal's NPU reference and on onnxruntime (optimizations "
                         "off), and on the torch model when --model and --checkpoint are given; print per output "
                         "cosine, PSNR and LSB mismatch counts, and the first layer where they diverge.")
    ver.add_argument("onnx", help="path of the .onnx file")
    src = ver.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a .npy file holding the input (one-input models)")
    src.add_argument("--random-input", type=shape, metavar="SHAPE", help="use N(0,1) random input of this shape")
    ver.add_argument("--model", help=MODEL_HELP + "; compares with torch too (needs --checkpoint)")
    ver.add_argument("--checkpoint", help="dal checkpoint for --model")
    ver.add_argument("--seed", type=int, default=0, help="seed for --random-input (default 0)")
    ver.add_argument("--strict", action="store_true",
                     help="exit 1 unless the verdict passes: the integer model (dal.convert of --model) equals "
                          "the NPU reference on every element, and every layer-by-layer difference is a near-tie "
                          "(1 LSB, within the float32 error bound of a rounding boundary)")
    ver.add_argument("--json", action="store_true",
                     help="print the report as JSON (ParityReport.to_dict(): verdict, per-output pairs, every "
                          "layer row with its LSB counts and cosines, the integer-model row) instead of text")


def _add_report(sub) -> None:
    rep = sub.add_parser("report", help="HTML report: per-layer error, histograms, sensitivity, parity",
                         description="Write one self-contained HTML report of a QAT checkpoint: per-layer error, "
                         "weight and activation histograms with clipping ranges, sensitivity ranking, and with "
                         "--onnx the dal.verify parity summary. Needs matplotlib: pip install 'dal[report]'.")
    rep.add_argument("--model", required=True, help=MODEL_HELP)
    rep.add_argument("--checkpoint", required=True, help="dal checkpoint (dal.save_checkpoint) of the QAT model")
    src = rep.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="FACTORY", help="package.module:function returning an iterable of batches "
                     "(tensors or (inputs, targets) pairs)")
    src.add_argument("--random-input", type=shape, metavar="SHAPE", help="N(0,1) batches of this shape")
    rep.add_argument("--onnx", help="exported QDQ ONNX file: adds the dal.verify parity summary")
    rep.add_argument("--out", default="report.html", help="output file (default report.html)")
    rep.add_argument("--num-batches", type=int, default=4, help="batches analysed (default 4)")
    rep.add_argument("--no-sensitivity", action="store_true", help="skip the sensitivity ranking")
    rep.add_argument("--seed", type=int, default=0, help="seed for --random-input (default 0)")


def build_parser() -> argparse.ArgumentParser:
    """The ``dal`` argument parser (subcommands inspect, export, verify, report)."""
    p = _Parser(prog="dal", description="dal: quantization-aware training for NPUs, QDQ ONNX "
                "export and bit-exact parity checks against an NPU reference.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dal {_version()}",
                   help="print dal's version (the installed package's metadata) and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    ins = sub.add_parser("inspect", help="show what an exported QDQ ONNX file holds",
                         description="Print the opset, the dal metadata (recipe, hardware, requantizer), the "
                         "operator counts, and for every compute node the format and granularity of each input.")
    ins.add_argument("onnx", help="path of the .onnx file")
    ins.add_argument("--json", action="store_true", help="print plain JSON instead of a table")
    _add_export(sub)
    _add_verify(sub)
    _add_report(sub)
    add_estimate(sub, MODEL_HELP)
    return p


def _version() -> str:
    import dal

    return dal.__version__


def _user_error(err: BaseException) -> bool:
    """True for errors about the user's input: dal's own (ValueError subclasses: recipe, hardware,
    export, NPU, verify input), files (OSError), a missing extra (an ImportError that says what to
    pip install), a failed C++ build (BuildError)."""
    if isinstance(err, (CliError, ValueError, OSError)):
        return True
    if isinstance(err, ImportError):  # a missing extra says "pip install ..."; any other is a bug
        return "pip install" in str(err)
    build = sys.modules.get("dal.npu.build")  # BuildError can only be raised once that module is loaded
    return build is not None and isinstance(err, build.BuildError)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``dal`` console script; returns the exit status (2: a user error, one line)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    handlers = {"inspect": cmd_inspect, "export": cmd_export, "verify": cmd_verify, "report": cmd_report, "estimate": cmd_estimate}
    try:
        return handlers[args.command](args)
    except Exception as err:  # noqa: BLE001 - sorted by _user_error; the rest re-raised with its traceback
        if not _user_error(err):
            raise
        message = one_line(err).removeprefix(f"{args.command}: ")  # "verify: ..." from dal.verify itself
        print(f"dal {args.command}: error: {message}", file=sys.stderr)
        return 2
