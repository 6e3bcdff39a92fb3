"""What each ``dal`` subcommand does once its arguments are parsed; each returns the exit status.

Every file named on the command line is checked before any work starts, and a failure that is
the user's (a file that is not a checkpoint, a checkpoint of another model) is a CliError that
names the option and the file.
"""
from __future__ import annotations

import itertools
import zipfile

from .args import CliError, existing_file, one_line, output_file


def cmd_inspect(args) -> int:
    """``dal inspect FILE``: formats per layer, sparsity, opset, metadata (text or --json)."""
    import json

    import onnx

    from .inspect_onnx import describe, format_text

    existing_file("", args.onnx)
    try:
        model = onnx.load(args.onnx)
    except Exception as err:  # noqa: BLE001 - any parse failure is the user's file
        raise CliError(f"{args.onnx} is not a readable ONNX file (truncated, or not ONNX): {one_line(err, 200)}") from None
    info = describe(model)
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def _read_checkpoint(path: str) -> None:
    """Fail fast, naming --checkpoint, unless ``path`` is a dict written by dal.save_checkpoint.

    ``mmap=True`` maps the tensors instead of reading them: the check costs the pickle, not the weights.
    """
    import torch

    existing_file("--checkpoint", path)
    hint = "give a file written by dal.save_checkpoint (or the QAT callback)"
    if not zipfile.is_zipfile(path):  # torch.save's format; anything else fails torch.load obscurely
        raise CliError(f"--checkpoint {path} is not a dal checkpoint (not a file torch.save wrote); {hint}")
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # noqa: BLE001 - whatever torch.load says, the file is at fault
        raise CliError(f"--checkpoint {path} is not a dal checkpoint (torch.load: {type(err).__name__}: "
                       f"{one_line(err, 200)}); {hint}") from None
    missing = [k for k in ("state_dict", "recipe") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        what = f"a {type(ckpt).__name__}" if not isinstance(ckpt, dict) else f"a dict without {missing}"
        raise CliError(f"--checkpoint {path} is not a dal checkpoint: it holds {what}; {hint}")


def _check_runs(make, factory: str, example: tuple) -> None:
    """The float model must run on the example input: a wrong input shape is named as such, not
    reported as a failure somewhere inside prepare_qat."""
    import torch

    try:
        with torch.no_grad():
            make().eval()(*example)
    except Exception as err:  # noqa: BLE001 - the user's model on the user's shape
        shapes = ", ".join(str(tuple(x.shape)) for x in example)
        raise CliError(f"--model {factory} does not run on an input of shape {shapes} ({type(err).__name__}: "
                       f"{one_line(err, 300)}); give the shape the model takes") from None


def load_model(factory: str, checkpoint, example):
    """The QAT model of ``--model`` restored from ``--checkpoint`` (both checked, errors name them)."""
    from ..checkpoint import load_checkpoint, resolve_factory

    if not checkpoint:
        raise CliError("--model needs --checkpoint (a file written by dal.save_checkpoint)")
    try:
        make = resolve_factory(factory)
    except ValueError as err:
        raise CliError(f"--model {factory}: {err}") from None
    _read_checkpoint(checkpoint)
    _check_runs(make, factory, example)
    try:
        return load_checkpoint(checkpoint, factory, example_inputs=example)
    except ValueError as err:  # the recipe / hardware stored in the checkpoint, against this model
        raise CliError(f"--checkpoint {checkpoint} with --model {factory}: {one_line(err)}") from None
    except RuntimeError as err:
        if "Error(s) in loading state_dict" not in str(err):
            raise
        problems = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CliError(f"--checkpoint {checkpoint} does not fit --model {factory}: "
                       f"{problems[0] if problems else one_line(err, 300)}{more}; "
                       "give the model factory the checkpoint was trained with") from None


def cmd_export(args) -> int:
    """``dal export``: checkpoint + model factory -> QDQ ONNX."""
    import torch

    import dal

    output_file("-o", args.output)
    x = torch.randn(args.input_shape)
    model = load_model(args.model, args.checkpoint, (x,))
    dal.export_onnx(model, (x,), args.output, opset=args.opset, dynamic_batch=args.dynamic_batch)
    print(f"wrote {args.output}")
    return 0


def _verify_input(path: str):
    import numpy as np
    import torch

    existing_file("--input", path)
    try:
        return torch.from_numpy(np.load(path, allow_pickle=False))
    except Exception as err:  # noqa: BLE001 - not a .npy of numbers: the file is at fault
        raise CliError(f"--input {path} is not a .npy array file ({one_line(err, 200)}); "
                       "write one with numpy.save, or use --random-input SHAPE") from None


def cmd_verify(args) -> int:
    """``dal verify FILE``: NPU reference vs onnxruntime (and torch with --model); with --strict the exit status
    is 1 when ``ParityReport.verdict()`` fails (the verdict the printed report states first), else 0. With
    --json the report is printed as ``json.dumps(ParityReport.to_dict())`` (one JSON document on stdout)."""
    import torch

    import dal

    existing_file("", args.onnx)
    if args.checkpoint and not args.model:
        raise CliError("--checkpoint needs --model (the model factory, e.g. dal_examples.zoo:MnistCNN)")
    if args.input:
        x = _verify_input(args.input)
    else:
        x = torch.randn(args.random_input, generator=torch.Generator().manual_seed(args.seed))
    model = load_model(args.model, args.checkpoint, (x,)) if args.model else None
    report = dal.verify(args.onnx, model, (x,))
    if args.json:  # strict JSON: non-finite floats are strings (ParityReport.to_dict)
        import json

        print(json.dumps(report.to_dict(), indent=2, allow_nan=False))
    else:
        print(report)
    if args.strict and not report.verdict():  # the one verdict: integer model == NPU, near-ties only layer by layer
        return 1
    return 0


def _report_data(args):
    """(batches, example inputs) for ``dal report``: --data's iterable or N(0,1) --random-input batches."""
    import torch

    from ..calibration.batches import cached_inputs
    from ..checkpoint import resolve_factory

    if args.random_input:
        g = torch.Generator().manual_seed(args.seed)
        data = [torch.randn(args.random_input, generator=g) for _ in range(args.num_batches)]
        return data, (data[0],)
    try:
        data = resolve_factory(args.data)()
    except ValueError as err:
        raise CliError(f"--data {args.data}: {err}") from None
    if iter(data) is data:  # a one-shot iterator: keep the batches the report will read
        data = list(itertools.islice(data, args.num_batches))
    first = next(iter(data), None)
    if first is None:
        raise CliError(f"--data {args.data} yielded no batch")
    return data, cached_inputs([first], 1)[0][0]  # the model's positional inputs of one batch


def cmd_report(args) -> int:
    """``dal report``: the self-contained HTML report of a checkpoint (build_report)."""
    from ..analysis.plots import require_matplotlib
    from ..analysis.report import build_report

    require_matplotlib("dal report")  # before minutes of analysis, not after
    output_file("--out", args.out)
    if args.onnx:
        existing_file("--onnx", args.onnx)
    if args.num_batches < 1:
        raise CliError(f"--num-batches {args.num_batches}: must be at least 1")
    data, example = _report_data(args)
    model = load_model(args.model, args.checkpoint, tuple(example))
    path = build_report(model, data, None, args.onnx, args.out, num_batches=args.num_batches,
                        sensitivity=not args.no_sensitivity, progress=False)
    print(f"wrote {path}")
    return 0
