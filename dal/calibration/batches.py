"""Iterate model inputs out of user data, with the checks every calibration method and analysis shares."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch

from .loop import _check_finite, _model_inputs


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
    it = tqdm(data, total=num_batches, desc=desc, disable=not progress, leave=False)
    for i, batch in enumerate(it):
        if num_batches is not None and i >= num_batches:
            break
        args, kwargs = input_fn(batch) if input_fn else _model_inputs(batch, i)
        if check_finite:
            _check_finite(args, kwargs, i)
        seen += 1
        yield args, kwargs
    if seen == 0:
        raise ValueError(f"{desc}: data yielded no batch; pass a non-empty DataLoader or list of batches")


def cached_inputs(data: Iterable, num_batches: Optional[int] = None, **kwargs) -> list[tuple[tuple, dict]]:
    """``iter_inputs`` materialised: the searches and analyses run the same batches many times."""
    return list(iter_inputs(data, num_batches, **kwargs))


def run_model(model: torch.nn.Module, args: tuple, kwargs: dict, index: int = 0):
    """``model(*args, **kwargs)``; a failure names the batch and its input shapes (wrong shapes)."""
    try:
        return model(*args, **kwargs)
    except Exception as err:
        shapes = [tuple(a.shape) for a in args if torch.is_tensor(a)]
        shapes += [(k, tuple(v.shape)) for k, v in kwargs.items() if torch.is_tensor(v)]
        raise ValueError(f"batch {index} (input shapes {shapes}) failed in the model: "
                         f"{type(err).__name__}: {err}") from err
