"""Python control flow on tensor *values* is refused at export, naming the source line.

The TorchScript exporter records the operators one example forward ran. A loop whose count or a
branch whose side is decided by a value the inputs computed (``while x.abs().max() > 1:``,
``for _ in range(int(x.sum())):``, ``if (mask == 0).any():``) is unrolled or cut to the path this
example took, without a word: torch only issues a ``TracerWarning``. The file is then right for
the example and wrong for other inputs (zeros, a larger value).

torch warns the same way for flow on *shapes* (``if N != self.n:``, timm's size asserts), which
is static for a fixed input size, so the warning alone cannot decide. When the trace warned at
all, one more forward runs with a ``TorchFunctionMode`` that marks every tensor computed from an
input and records each conversion of a marked tensor to a Python value (``bool()``, ``int()``,
``float()``, ``__index__``, ``.item()``, ``.tolist()``, ``.numpy()``) at the first calling frame
outside torch's own files. Shapes are ints in eager mode, so they never count; values computed
from parameters and buffers alone are constants of the export and do not count either.

    check_static(model, args, context)   # ExportError listing file:line and the source text

The refusal says how to make the flow static: a fixed loop count, tensor ops (``torch.where``,
``torch.clamp``, masks) instead of a branch on a value, or the value passed in as a constant.
"""
from __future__ import annotations

import contextlib
import inspect
import linecache
import os
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .. import nest
from .errors import ExportError

#: Tensor methods that hand a tensor's value to Python
_TO_PYTHON = {"__bool__": "bool()", "__int__": "int()", "__float__": "float()", "__index__": "an index",
              "__complex__": "complex()", "item": ".item()", "tolist": ".tolist()", "numpy": ".numpy()"}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _tensors(value):
    """The tensors in a call's arguments or result (tuples, lists, dicts, return types)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class _ValueFlow(TorchFunctionMode):
    """Marks the tensors computed from ``inputs``; records their conversions to Python values."""

    def __init__(self, inputs):
        super().__init__()
        self.keep = list(inputs)  # held for the forward's duration: an id is unique only while alive
        self.ids = {id(t) for t in self.keep}
        self.found: dict[tuple[str, int, str], int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        marked = any(id(t) in self.ids for t in _tensors((args, kwargs)))
        if marked and getattr(func, "__name__", "") in _TO_PYTHON:
            frame = inspect.currentframe().f_back
            while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
                frame = frame.f_back
            if frame is not None:
                key = (frame.f_code.co_filename, frame.f_lineno, _TO_PYTHON[func.__name__])
                self.found[key] = self.found.get(key, 0) + 1
        out = func(*args, **kwargs)
        if marked:
            for t in _tensors(out):
                if id(t) not in self.ids:
                    self.keep.append(t)
                    self.ids.add(id(t))
        return out


@contextlib.contextmanager
def _no_mha_fast_path():
    """torch's fused attention path off for this forward, as in the trace (which runs with grad
    enabled for that reason): its checks read mask values inside torch. The forward itself runs
    without grad, so a module caching a tensor in eval (timm LeViT's attention biases) keeps a
    leaf that ``copy.deepcopy`` (dal.convert) accepts."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


def value_dependent_lines(model, args: tuple, context: Callable = contextlib.nullcontext) -> list[str]:
    """``file:line: <conversion> of a value computed from the inputs (n calls): <source>`` for each
    place ``model(*args)``, run inside ``context()``, hands a value computed from its inputs to
    Python; [] when there is none."""
    inputs = nest.tensors(args)
    with context(), torch.no_grad(), _no_mha_fast_path(), _ValueFlow(inputs) as flow:
        model(*args)
    lines = []
    for (path, lineno, how), n in flow.found.items():
        text = linecache.getline(path, lineno).strip()
        calls = f" ({n} calls)" if n > 1 else ""
        lines.append(f"{os.path.basename(path)}:{lineno}: {how} of a value computed from the inputs{calls}"
                     + (f": `{text}`" if text else "") + f"  [{path}]")
    return lines


def check_static(model, args: tuple, context: Callable = contextlib.nullcontext) -> None:
    """Raise :class:`ExportError` when ``model(*args)`` (inside ``context()``) has Python control
    flow on tensor values: the trace would hold only the path the example took. The message names
    every such line and how to make it static."""
    lines = value_dependent_lines(model, args, context)
    if not lines:
        return
    listing = "\n".join(f"  {line}" for line in lines)
    raise ExportError(
        f"{type(model).__name__}: its forward hands tensor values to Python control flow, so the exported "
        f"graph would hold only the path this example took (a loop unrolled for its iteration count, one side "
        f"of a branch) and be wrong for other inputs:\n{listing}\n"
        "Make it static: loop a fixed number of times (for _ in range(K)), express the condition with tensor "
        "ops (torch.where, torch.clamp, a mask multiplied in) instead of a Python branch on a value, or compute "
        "the value outside the model and pass it as a constant.")
