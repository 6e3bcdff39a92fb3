"""The one recorded forward: every module call and every torch function call of a model, traceable
or not, with its call site, the values it read and wrote, their shapes and dtypes.

Mechanism: the model's own forward runs unchanged, eagerly, inside a public
``torch.overrides.TorchFunctionMode`` (every torch function and Tensor method the Python
interpreter dispatches reaches it, at any depth of the module tree) with a forward pre-hook and a
forward hook (``always_call``) on every module (which module is running, what it read and
returned). Why this and not the alternatives: torch.fx stops at the first data-dependent branch,
list-of-levels loop or non-traceable call (FPN, detection heads, Hugging Face code), and
``torch.export`` captures an aten graph that replaces the user's Python forward (other call
names, other module paths, decompositions), while every reader here needs the calls as the
user's code makes them, with their module paths and source lines. The price is one example
forward; a forward fx does trace is also read as an fx graph by prepare (``dal.nn.own_forward``),
which needs no forward at all.

Inside a call the mode handles, the mode is off (torch pops it while its handler runs): a call is
recorded once, at the level the model's code made it (``F.interpolate``'s own torch calls are
not). Calls whose result holds no tensor (``x.shape``, ``x.size()``, ``x.dim()``) are shape queries
and are not recorded; an indexed assignment ``y[i] = x`` is, as a call that reads ``y`` and ``x`` and
writes a new version of ``y``. ``opaque(module)`` marks modules whose inside is of no interest to the
reader (a quantizer, a weighted layer): their call is recorded as one call, their outputs as new
values, and nothing inside them is. A ``torch.jit.ScriptModule`` gets no hooks (it runs as one
function of its parent).

Who captures with it, and how many forwards each makes:

* ``prepare_qat`` with ``example_inputs``: the one float forward before anything is swapped (which
  modules ran, who returned the model's outputs; the call sites of forwards fx cannot trace are
  keyed in the same forward by ``dal.prepare.call_sites``, whose own mode also routes them in
  training): 1 forward. A ``replace:`` recipe: operator replacement's forward before its swaps,
  and its forward after them, which is this record: 2 (3 when a forward does not trace: the
  discovery needs the replaced model's fx capture first). A detector adds its zero batch (its
  NPU part); without example inputs prepare makes no forward but that one;
* ``dal.convert``'s integer groups (``dal.convert.probe``): one forward of the QAT / integer model,
  quantizers and weighted layers opaque;
* the cost model (``dal.cost.torch_graph``): one forward, the layers it charges opaque.
"""
from __future__ import annotations

import contextlib
import inspect
import os
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..nest import tensors
from .record import Call, Record, meta_of

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

#: how many captures are running (:func:`capturing`)
_RUNNING = 0


def capturing() -> bool:
    """Whether a capture's forward is running (code that turns torch-function dispatch off for
    speed, as dal.convert's integer forms do, keeps it on then, so the calls are recorded)."""
    return _RUNNING > 0


def _flat(value, found: list) -> list:
    """The tensors of a call's arguments or result (tuples, lists, dicts, nested), in order; any
    other container (a ``ModelOutput``, a dataclass) by ``dal.nest``."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flat(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _flat(v, found)
    elif value is not None and not isinstance(value, (int, float, bool, str, torch.dtype, torch.device)):
        found.extend(tensors(value))
    return found


def _site() -> str:
    """``file.py:line`` of the first frame outside torch's package, above the recorder."""
    f = inspect.currentframe()
    f = f.f_back.f_back if f is not None and f.f_back is not None else None  # past _site and the handler
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f is not None else ""


class _Recorder(TorchFunctionMode):
    """The mode and the hooks of one capture (module docstring)."""

    def __init__(self, record: Record, paths: dict, opaque: Callable, functions: bool, sites: bool,
                 keep_args: bool):
        super().__init__()
        self.record, self.paths, self.opaque = record, paths, opaque
        self.functions, self.sites, self.keep_args = functions, sites, keep_args
        self.stack: list = []   # (module, is opaque, input keys, input meta) of the running forwards
        self.hidden = 0          # how many opaque forwards are running
        self.busy = False        # a hook is running: its own torch calls are not the model's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hidden or self.busy or not self.functions:  # busy: the hooks' own shape reads
            return func(*args, **kwargs)
        site = _site() if self.sites else ""
        out = func(*args, **kwargs)
        made = [out] if type(out) is torch.Tensor else _flat(out, [])
        if not made and out is None and args and isinstance(args[0], torch.Tensor) and \
                getattr(func, "__name__", "") == "__setitem__":
            made = [args[0]]  # y[i] = x: a new version of y, written from y and x
        if made:
            read = _flat(args, [])
            if kwargs:
                _flat(kwargs, read)
            ins = self.record.read(read)
            owner = self.paths.get(id(self.stack[-1][0]), "") if self.stack else ""
            self.record.calls.append(Call(
                "function", func, owner, ins, self.record.write(made), meta_of(read), meta_of(made),
                len(self.stack), site, False, args if self.keep_args else (), kwargs if self.keep_args else None))
        return out

    def enter(self, module, args, kwargs):
        self.busy = True
        try:
            self._enter(module, args, kwargs)
        finally:
            self.busy = False

    def leave(self, module, args, kwargs, out):
        self.busy = True
        try:
            self._leave(module, args, kwargs, out)
        finally:
            self.busy = False

    def _enter(self, module, args, kwargs):
        self.record.called.add(id(module))
        hide = bool(self.opaque(module))
        if self.hidden:
            self.stack.append((module, hide, (), ()))
        else:
            read = _flat(kwargs, _flat(args, []))
            self.stack.append((module, hide, self.record.read(read), meta_of(read)))
        self.hidden += hide

    def _leave(self, module, args, kwargs, out):
        if not self.stack or self.stack[-1][0] is not module:
            return  # an exception unwound a forward whose pre-hook never ran
        _, hide, ins, in_meta = self.stack.pop()
        self.hidden -= hide
        if torch.is_tensor(out):
            self.record.note(out, id(module))
        elif isinstance(out, (list, tuple)):  # an element of a returned list / tuple: keyed apart
            for i, o in enumerate(out):
                self.record.note(o, (id(module), i))
        if self.hidden:
            return
        made = _flat(out, [])
        # an opaque module's outputs are new values; any other module passes on the values the
        # calls inside it wrote (a value it returns unseen, e.g. made by a C++ extension, is new)
        outs = self.record.write(made) if hide else self.record.read(made)
        self.record.calls.append(Call(
            "module", module, self.paths.get(id(module), ""), ins, outs, in_meta, meta_of(made), len(self.stack),
            "", hide, tuple(args) if self.keep_args else (), dict(kwargs) if self.keep_args else None))


@contextlib.contextmanager
def recording(model: nn.Module, opaque: Optional[Callable] = None, functions: bool = True, sites: bool = False,
              keep_args: bool = False, into: Optional[Record] = None) -> Iterator[Record]:
    """Record every forward of ``model`` run inside the block into the :class:`Record` it yields
    (``into``, or a new one).

    ``opaque(module) -> bool``: modules recorded as one call, nothing inside them (default: none).
    ``functions``: record torch function calls (False: module calls only, no mode entered).
    ``sites``: each function call's calling line (a frame walk per call: it can double the cost of a
    recorded forward). ``keep_args``: keep each
    call's arguments (their tensors stay alive as long as the record). The root's outputs
    (``Record.outputs``) are those of the last forward of ``model`` itself."""
    global _RUNNING
    record = Record() if into is None else into
    paths = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(mod), path)
    rec = _Recorder(record, paths, opaque or (lambda m: False), functions, sites, keep_args)

    def leave_root(module, args, kwargs, out):
        record.ran = True
        record.outputs = record.read(tensors(out))
        record.returned = out

    hooks = []
    for mod in model.modules():
        if isinstance(mod, torch.jit.ScriptModule):
            continue  # no Python hooks on a scripted module: it runs as one call of its parent
        hooks.append(mod.register_forward_pre_hook(rec.enter, with_kwargs=True))
        hooks.append(mod.register_forward_hook(rec.leave, with_kwargs=True, always_call=True))
    hooks.append(model.register_forward_hook(leave_root, with_kwargs=True))
    _RUNNING += 1
    try:
        with (rec if functions else contextlib.nullcontext()):
            yield record
    finally:
        _RUNNING -= 1
        for h in hooks:
            h.remove()


def capture(model: nn.Module, *args, opaque: Optional[Callable] = None, functions: bool = True,
            sites: bool = True, keep_args: bool = False, **kwargs) -> Record:
    """One forward ``model(*args, **kwargs)`` recorded (:func:`recording`), as the model's state
    leaves it (the caller sets train / eval, grad and quantizer states)."""
    with recording(model, opaque, functions, sites, keep_args) as record:
        model(*args, **kwargs)
    return record
