"""Iterate model inputs out of user data, with the checks every calibration method and analysis shares."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch


def model_inputs(batch, index: int = 0) -> tuple[tuple, dict]:
    """(args, kwargs) for ``model`` from one batch: a tensor, an ``(inputs, targets)`` pair whose
    first element is the input (or a tuple of inputs), or a dict of keyword inputs. Anything
    else raises ``ValueError`` naming batch ``index`` and the ``input_fn=`` way out."""
    if torch.is_tensor(batch):
        return (batch,), {}
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if torch.is_tensor(first):
            return (first,), {}
        if isinstance(first, (list, tuple)):
            return tuple(first), {}
        if isinstance(first, dict):
            return (), first
    raise ValueError(f"calibration batch {index} has type {type(batch).__name__}: expected a tensor, an "
                     "(inputs, targets) tuple, or a dict of keyword inputs; pass input_fn=... to unpack it")


def check_finite_inputs(args: tuple, kwargs: dict, index: int = 0) -> None:
    """Raise ``ValueError`` naming batch ``index`` and the input when a float input holds NaN/Inf."""
    for pos, t in list(enumerate(args)) + list(kwargs.items()):
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"calibration batch {index}, input {pos!r}: {bad} NaN/Inf value(s); "
                             "clean the data (scales were not updated from this batch)")


def iter_inputs(data: Iterable, num_batches: Optional[int] = None, *, input_fn: Optional[Callable] = None,
                progress: bool = False, desc: str = "dal", check_finite: bool = True) -> Iterator[tuple[tuple, dict]]:
    """Yield ``(args, kwargs)`` for ``model(*args, **kwargs)`` from each batch of ``data``.

    Batches are tensors, ``(inputs, targets)`` tuples, dicts of keyword inputs, or anything
    ``input_fn(batch) -> (args, kwargs)`` unpacks. A batch with NaN/Inf inputs raises a
    ``ValueError`` naming the batch *before* it is yielded (so it never reaches an observer);
    ``data`` that yields nothing raises too, after the loop.
    """
    if data is None:
        raise ValueError(f"{desc}: data is None; pass a DataLoader or a list of batches")
    from tqdm.auto import tqdm

    seen = 0
    it = tqdm(data, total=progress_total(data, num_batches), desc=desc, disable=not progress, leave=False)
    for i, batch in enumerate(it):
        if num_batches is not None and i >= num_batches:
            break
        args, kwargs = input_fn(batch) if input_fn else model_inputs(batch, i)
        if check_finite:
            check_finite_inputs(args, kwargs, i)
        seen += 1
        yield args, kwargs
    if seen == 0:
        raise ValueError(f"{desc}: data yielded no batch; pass a non-empty DataLoader or list of batches")


def progress_total(data, num_batches: Optional[int] = None) -> Optional[int]:
    """The progress bar's total: ``min(num_batches, len(data))`` when ``data`` has a length
    (``len(data)`` without ``num_batches``), else ``None`` (unknown) — never a count of batches
    the data does not have."""
    try:
        length = len(data)
    except TypeError:  # a generator, an IterableDataset's DataLoader: its length is unknown
        return None
    return length if num_batches is None else min(num_batches, length)


def cached_inputs(data: Iterable, num_batches: Optional[int] = None, **kwargs) -> list[tuple[tuple, dict]]:
    """``iter_inputs`` materialised: the searches and analyses run the same batches many times."""
    return list(iter_inputs(data, num_batches, **kwargs))


def run_model(model: torch.nn.Module, args: tuple, kwargs: dict, index: int = 0, what: str = "batch"):
    """``model(*args, **kwargs)``; a failure names the batch and its input shapes (wrong shapes).

    A torchvision detector runs its NPU part (``dal.prepare.boundary``: backbone + heads) on the
    batch, which must be one normalised image tensor ``(B, 3, H, W)``; a dict, a list of images
    or a wrong rank is a one-line ``ValueError`` naming the batch."""
    from ..prepare.boundary import NPUPart, check_batch, is_detector

    if is_detector(model):
        if kwargs or len(args) != 1:
            got = f"a dict with keys {sorted(map(str, kwargs))[:6]}" if kwargs else f"{len(args)} inputs"
            raise ValueError(f"{what} {index}: a detector's {what.split()[0]} data must be normalised image batches "
                             f"(B, 3, H, W) tensors (the NPU part's input), got {got}; pass input_fn=... to unpack it")
        check_batch(args[0], f"{what} {index}")
        model = NPUPart(model)
    try:
        return model(*args, **kwargs)
    except Exception as err:
        shapes = [tuple(a.shape) for a in args if torch.is_tensor(a)]
        shapes += [(k, tuple(v.shape)) for k, v in kwargs.items() if torch.is_tensor(v)]
        raise ValueError(f"{what} {index} (input shapes {shapes}) failed in the model: "
                         f"{type(err).__name__}: {err}{_call_hint(err, args, kwargs)}") from err


def _call_hint(err: Exception, args: tuple, kwargs: dict) -> str:
    """For a ``TypeError`` about the forward's arguments: how the batch was passed, the batch
    conventions and ``input_fn``; else nothing."""
    if not isinstance(err, TypeError) or "argument" not in str(err):
        return ""
    how = f"{len(args)} positional input(s)" + (f" and keyword inputs {sorted(map(str, kwargs))[:6]}" if kwargs else "")
    return (f". The model was called with {how}: a batch is a tensor; an (inputs, targets) tuple or list whose "
            "first element is the input, a tuple of inputs for a model with several (((img, vec), target), not "
            "(img, vec)); or a dict of keyword inputs (model(**batch)). For any other layout pass "
            "input_fn=lambda batch: (args, kwargs), called as model(*args, **kwargs), e.g. "
            "input_fn=lambda b: ((b['image'], b['vec']), {})")
