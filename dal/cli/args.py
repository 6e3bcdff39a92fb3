"""Checks of what the user typed: shapes, files that must exist, where outputs go; one-line errors."""
from __future__ import annotations

import argparse
import os
import re


class CliError(Exception):
    """A user mistake: printed as one line with what to do, exit status 2."""


def shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` (or ``"1x3x224x224"``) -> ``(1, 3, 224, 224)``; every part a positive integer.

    An empty or non-numeric part (``"8,x,28"``, ``"1,,3"``) is an error, never skipped.
    """
    parts = re.split(r"[,x]", text.strip())
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape: write positive integers separated by "
                                         "commas, like 1,3,224,224") from None
    if any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape of positive sizes; write it like 1,3,224,224")
    return dims


def existing_file(flag: str, path: str) -> str:
    """``path`` if it is a file, else CliError naming ``flag`` (e.g. ``--checkpoint``; "" for a positional)."""
    named = f"{flag} {path}" if flag else path
    if os.path.isdir(path):
        raise CliError(f"{named}: is a directory, not a file")
    if not os.path.isfile(path):
        raise CliError(f"{named}: no such file")
    return path


def output_file(flag: str, path: str) -> str:
    """``path`` if its folder exists (checked before the work, not after), else CliError."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"{flag} {path}: is a directory; give a file name, e.g. {os.path.join(path, 'model.onnx')}")
    if not os.path.isdir(folder):
        raise CliError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    return path


def one_line(err: BaseException, limit: int = 1000) -> str:
    """The message of ``err`` on one line (lines joined by ``; ``), at most ``limit`` characters."""
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
