"""``dal estimate``: the latency table of an exported file, or of a model factory + recipe.

    dal estimate model.onnx [--hardware a2000] [--json]
    dal estimate --model torchvision.models:resnet18 --recipe int8_balanced --hardware a2000 \\
                 --input-shape 1,3,224,224
"""
from __future__ import annotations

from .args import CliError, existing_file, one_line


def add_estimate(sub, model_help: str) -> None:
    """Register the ``estimate`` subcommand on the ``dal`` subparsers."""
    from .args import shape

    est = sub.add_parser("estimate", help="estimated latency per layer and per engine from the hardware's cost model",
                         description="Time every layer by the roofline of the hardware model's cost: section "
                         "(MACs, bytes moved, engine, format; compute vs bandwidth) and print the table, the total "
                         "and the breakdown by engine. Give an exported .onnx file, or --model with --recipe and "
                         "--input-shape (the model is prepared, not trained: formats are what matters).")
    est.add_argument("onnx", nargs="?", help="exported QDQ ONNX file (its dal metadata names the hardware)")
    est.add_argument("--model", help=model_help)
    est.add_argument("--checkpoint", help="dal checkpoint for --model (its recipe is used)")
    est.add_argument("--recipe", help="recipe for --model without --checkpoint (bundled name or YAML path)")
    est.add_argument("--hardware", help="hardware model (bundled name or YAML path); default: the file's / recipe's")
    est.add_argument("--input-shape", type=shape, help="input shape for --model, e.g. 1,3,224,224")
    est.add_argument("--json", action="store_true", help="print plain JSON instead of the table")


def cmd_estimate(args) -> int:
    """``dal estimate``: print ``dal.estimate``'s table (or --json)."""
    import json

    from ..cost import estimate

    if (args.onnx is None) == (args.model is None):
        raise CliError("give either an .onnx file or --model (with --recipe or --checkpoint, and --input-shape)")
    if args.onnx is not None:
        existing_file("", args.onnx)
        est = estimate(args.onnx, args.hardware)
    else:
        model, example = _prepared(args)
        est = estimate(model, args.hardware, example)
    print(json.dumps(est.to_dict(), indent=2) if args.json else est.table())
    return 0


def _prepared(args):
    import torch

    import dal

    from ..checkpoint import resolve_factory
    from .commands import load_model

    if args.input_shape is None:
        raise CliError("--model needs --input-shape, e.g. --input-shape 1,3,224,224")
    x = torch.randn(args.input_shape)
    if args.checkpoint is not None:
        return load_model(args.model, args.checkpoint, (x,)), (x,)
    if args.recipe is None:
        raise CliError("--model needs --recipe (e.g. int8_balanced) or --checkpoint")
    try:
        make = resolve_factory(args.model)
    except (ImportError, AttributeError, ValueError) as err:
        raise CliError(f"--model {args.model}: {one_line(err)}") from None
    model = make().eval()
    return dal.prepare_qat(model, recipe=args.recipe, hardware=args.hardware, example_inputs=(x,)), (x,)
