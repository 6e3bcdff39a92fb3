"""Functional ops in forwards torch.fx cannot trace, found and quantized by call site.

torchvision's ``FeaturePyramidNetwork`` (a loop over a dict of features), its detection heads
(a loop over a list of levels) and ``IntermediateLayerGetter`` do not trace with torch.fx, so
their ``+``, ``F.interpolate``, ``torch.cat`` and reshapes were invisible to prepare.

Mechanism: a ``TorchFunctionMode`` entered around the forward of each such *owner* (a forward
pre-hook, and a forward hook with ``always_call=True`` so an exception never leaves it on).
Every torch function the Python interpreter dispatches while the owner runs reaches the mode;
the mode keeps only calls whose calling frame is the owner's own ``forward`` code (calls
inside submodules, losses or post-processing helpers are someone else's), and keys each by
``<kind>_l<line>_<n>``: the source line of the call and its occurrence on that line in this
forward (a loop over five pyramid levels gives five keys, one per level, as the exported graph
has five ops). ``discover`` runs the float model once with a recording mode and returns the
sites; ``install`` puts a QAdd / QMul / QCat / QMatMul / QGridSample / QScatterAdd / QGather per
quantized site, or an ``Fp16Function`` per softmax the hardware runs as an FP16 island, in
``owner.dal_sites`` (a ModuleDict: the quantizers are in ``state_dict``, so ``prepare_qat`` +
``load_state_dict`` restores them) and registers the hooks that route each site's call to its
module. A scatter-add / gather call (``index_put_(accumulate=True)``, ``scatter_add``,
``index_add``; ``gather``, ``index_select``, ``take_along_dim``) is routed with its own arguments
(``dal.nn.scatter_add.scatter_call``, ``dal.nn.gather.gather_call_args``); an in-place spelling
writes the module's result into its tensor with ``copy_``, so the caller's tensor holds it.

Why not the alternatives: ``torch.export`` captures these forwards, but as an aten graph that
replaces the user's Python forward (training then runs an inference graph with other module
paths); fx with concrete list/dict arguments needs the structure of every argument and still
fails on shape-dependent Python. The mode needs one example forward (the structure of the
loops), runs the user's own code unchanged, and also sees the calls torch.jit tracing sees,
so the export holds the same quantizers the training used.

A site called again in a later call of the same owner (an owner module shared between calls)
reuses the same key and so the same quantizers: one set of statistics per call site of the
owner's code, as for a module called several times (see ``FakeQuantizer.forward``).

Cost: while an owner runs, every torch call of its own forward, and of the modules it calls,
reaches the mode (torch's dispatch to a Python mode, once per call). A call whose name cannot
be a routed kind goes straight through, before any frame is read.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..nn.grid_sample import grid_sample_args
from ..nn.tree import has_instance_attribute
from .float_ops import FloatOp
from .functional_ops import call_form
from .site_kinds import classify_call, index_call, island_functions, kind_names

#: frames of torch's own dispatch wrappers between a user's call and the mode
_TORCH_DIR = os.path.dirname(torch.__file__)
_WRAPPER_FILES = {os.path.join(_TORCH_DIR, f) for f in ("overrides.py", "_tensor.py", "functional.py", "_jit_internal.py",
                                                         os.path.join("nn", "functional.py"))}
SITES_ATTR = "dal_sites"


@dataclass(frozen=True)
class Site:
    """One call site: ``owner`` path, ``key`` (``add_l78_0``), ``kind`` ("add", "mul", "cat",
    "matmul", "grid_sample", "scatter_add", "gather" — quantizable — else None), ``op`` (the FloatOp
    of any other op; for a scatter-add or gather also its host op, listed when no recipe rule
    quantizes it), ``arity`` (the number of tensors a cat joins), ``dim`` (its axis), ``line``
    (file:line, for the report) and ``params``: grid_sample's ``(mode, padding_mode,
    align_corners)``, a scatter-add's ``(kind, dim)`` (``QScatterAdd``'s), a gather's ``(kind, dim)``
    (``QGather``'s)."""

    owner: str
    key: str
    kind: Optional[str]
    op: Optional[FloatOp]
    arity: int = 2
    dim: int = 0
    line: str = ""
    params: tuple = ()  # grid_sample: (mode, padding_mode, align_corners); scatter_add / gather: (kind, dim)

    @property
    def path(self) -> str:
        return f"{self.owner}.{SITES_ATTR}.{self.key}" if self.owner else f"{SITES_ATTR}.{self.key}"


def routes_island(site: Site) -> bool:
    """A float call site the mode can run as an FP16 island (a softmax, :func:`~.site_kinds.island_functions`):
    the hardware check makes it one where ``fp16_island.is_island`` says so."""
    return site.kind is None and site.op is not None and site.op.function in island_functions()


def _caller():
    """The frame that made the call the mode is handling (the caller of the mode's
    ``__torch_function__``, which calls this), past torch's dispatch wrappers."""
    f = inspect.currentframe().f_back.f_back
    while f is not None and f.f_code.co_filename in _WRAPPER_FILES:
        f = f.f_back
    return f


#: how many plain-function frames a call may sit below the owner's forward (helper calling helper)
_HELPER_DEPTH = 8
#: packages whose functions are the library's, not the user's: a call inside them is no call site
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,))


def _helper_of(frame, codes: frozenset) -> Optional[str]:
    """Whose call ``frame`` makes: ``""`` when it is the owner's own forward code (``codes``), the
    name of the helper function when the forward reaches it through plain functions only
    (Deformable-DETR's ``ms_deform_attn_core_pytorch(value, ...)``, transformers'
    ``multi_scale_deformable_attention``: module-level functions), None for anyone else's code: a
    method (a submodule's forward, the owner's loss method, a KV cache's ``update``: its first
    argument is ``self`` or ``cls``), torch's or torchvision's own functions, or a frame more than
    ``_HELPER_DEPTH`` plain functions below the forward."""
    if frame is None:
        return None
    if frame.f_code in codes:
        return ""
    f = frame
    for _ in range(_HELPER_DEPTH):
        if _method(f.f_code) or f.f_code.co_filename.startswith(_library_dirs()):
            return None
        f = f.f_back
        if f is None:
            return None
        if f.f_code in codes:
            name = frame.f_code.co_name
            return name if name.isidentifier() else "helper"
    return None


def _library_dirs() -> tuple:
    """torch's and (when imported) torchvision's package folders."""
    import sys
    tv = sys.modules.get("torchvision")
    return _LIBRARY_DIRS + ((os.path.dirname(tv.__file__) + os.sep,) if getattr(tv, "__file__", None) else ())


def _method(code) -> bool:
    """The code is a method's (its first argument is ``self`` or ``cls``), not a plain function's."""
    return code.co_argcount > 0 and code.co_varnames[0] in ("self", "cls")


def _owner_codes(owner: nn.Module) -> frozenset:
    """The forward's code, and the code of the comprehensions and lambdas written in it (their
    own frames before Python 3.12: ``[self.act(o) for o in out]`` is the forward's call too)."""
    # A decorated forward (transformers wraps its layers' forwards, functools.wraps keeping
    # __wrapped__) runs its own code in the innermost function, not in the wrapper.
    todo = [c for f in _wrapped_chain(type(owner).forward) if (c := getattr(f, "__code__", None)) is not None]
    found = set()
    while todo:
        c = todo.pop()
        found.add(c)
        todo += [k for k in c.co_consts if isinstance(k, type(c)) and k.co_name.startswith("<")]
    return frozenset(found)


def _wrapped_chain(fn) -> list:
    """``fn`` and each function its ``__wrapped__`` chain leads to (decorators using functools.wraps)."""
    chain = [fn]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 16:
        chain.append(chain[-1].__wrapped__)
    return chain


class _SiteMode(TorchFunctionMode):
    """Routes (or records) the calls made by one owner's own forward code."""

    def __init__(self, owner: nn.Module, path: str, record: Optional[dict] = None, flow: Optional[list] = None,
                 on_result=None):
        super().__init__()
        self.codes = _owner_codes(owner)
        self.sites = getattr(owner, SITES_ATTR, None)
        self.path, self.record, self.counts, self.flow = path, record, {}, flow
        self.on_result = on_result
        self.routable = kind_names()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Training runs every torch call of the owner's forward, and of everything it calls,
        # through here (thousands per step in a detector head). Only a call of a kind_names() name
        # can be routed, and the keys of those count only their own kind, so when
        # routing the rest is passed on before any frame is read (the recording run still
        # classifies every call, for the report).
        if self.record is None and getattr(func, "__name__", "") not in self.routable:
            return func(*args, **kwargs)
        frame = _caller()
        helper = _helper_of(frame, self.codes)
        if helper is None:
            return func(*args, **kwargs)
        key, result = self._call(func, args, kwargs, frame, helper)
        if self.flow is not None:  # discovery: which call's outputs feed which (dal.prepare.deformable)
            self.flow.append(Call(self.path, key, _tensors((args, kwargs)), _tensors(result)))
        return result

    def _call(self, func, args, kwargs, frame, helper: str):
        """``(key or None, result)``: the call, routed to its site's module when it has one."""
        kind, op, arity, dim = classify_call(func, args, kwargs)
        if kind is None and op is None:
            return None, func(*args, **kwargs)
        tag = kind or op.function
        tag = f"{tag}_{helper}" if helper else tag
        n = self.counts.get((tag, frame.f_lineno), 0)
        self.counts[(tag, frame.f_lineno)] = n + 1
        key = f"{tag}_l{frame.f_lineno}_{n}"
        if self.record is not None:
            line = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
            form = call_form(kind) if kind is not None else None
            if form == "index" and not _module_computes(kind, func, args, kwargs):
                kind = None  # listed as the host op it is (values broadcast, a bool mask): torch runs it
            params = grid_sample_args(args, kwargs, func is torch.grid_sampler) if form == "sampling" else \
                (index_call(func, args, kwargs)[1][0], dim) if form == "index" else ()
            site = self.record.setdefault((self.path, key), Site(self.path, key, kind, op, arity, dim, line, params))
            if self.on_result is not None and kind is not None and (self.sites is None or key not in self.sites):
                result = func(*args, **kwargs)
                self.on_result(site.path, result)  # who returned what (dal.prepare.example_run)
                return key, result
        if self.sites is not None and key in self.sites:
            if kind is not None:
                return key, _route(kind, self.sites[key], func, args, kwargs)
            if op is not None and op.function in island_functions():  # an FP16 island (prepare.check)
                return key, _island(self.sites[key], args, kwargs)
        return key, func(*args, **kwargs)


def _module_computes(kind: str, func, args, kwargs) -> bool:
    """Whether ``QScatterAdd`` / ``QGather`` computes this call of the discovery forward: its
    checks (``scatter_operands`` / ``gather_call``: an integer index in range, the updates of the
    index's shape) pass. A call torch runs that they refuse (values broadcast to the index, as an
    occupancy count ``index_put_((i,), ones(()), accumulate=True)``; a bool mask) stays torch's."""
    from ..nn.gather import gather_call
    from ..nn.scatter_add import scatter_operands

    call = index_call(func, args, kwargs)[1]
    try:
        if kind == "scatter_add":
            scatter_operands(call[0], call[2], call[3], call[4], call[1])
        else:
            gather_call(call[0], call[2], call[3], call[1])
    except ValueError:
        return False
    return True


def _route(kind: str, module: nn.Module, func, args, kwargs):
    """The call's result computed by its site's QAT module. An in-place scatter-add
    (``x.index_put_(..., accumulate=True)``, ``x.scatter_add_``, ``x.index_add_``) writes the
    module's result into ``x`` (``copy_``, autograd-tracked) and returns ``x``, as the call did."""
    if call_form(kind) == "sequence":
        return module(*(args[0] if args else kwargs["tensors"]))
    if kind == "scatter_add":
        _, _, x, index, src, in_place = index_call(func, args, kwargs)[1]
        y = module(x, index, src)
        return x.copy_(y) if in_place else y
    if kind == "gather":
        _, _, x, index = index_call(func, args, kwargs)[1]
        return module(x, index)
    return module(*args[:2])


def _island(module: nn.Module, args, kwargs):
    """A softmax call (``F.softmax(x, dim)``, ``torch.softmax``, ``x.softmax(dim)``; log_softmax
    alike) run by its ``Fp16Function`` (the method of that name on the fp16-rounded input)."""
    kwargs = dict(kwargs)
    kwargs.pop("_stacklevel", None)
    if args:
        x, rest = args[0], tuple(args[1:])
    else:
        x, rest = kwargs.pop("input", None), ()
        x = kwargs.pop("self") if x is None else x
    if len(rest) > 1 and isinstance(rest[1], int) and "dim" not in kwargs:  # F.softmax(x, dim, _stacklevel)
        rest = rest[:1] + rest[2:]
    return module(x, *rest, **kwargs)


@dataclass(frozen=True)
class Call:
    """One torch call of an owner's code in the discovery forward: its site ``key`` (None for an
    unlisted call: shapes, dtypes), and the tensors it read and made (``args``: its positional
    arguments' tensors, lists flattened, in order). The tensors are held, so ``id()`` stays unique
    while the record lives."""

    owner: str
    key: Optional[str]
    args: tuple
    outputs: tuple


def _tensors(value) -> tuple:
    """The tensors in ``value`` (nested tuples, lists and dicts), in order."""
    if torch.is_tensor(value):
        return (value,)
    if isinstance(value, dict):
        value = tuple(value.values())
    if isinstance(value, (list, tuple)):
        return tuple(t for v in value for t in _tensors(v))
    return ()


def _running_modes(module: nn.Module) -> list:
    """``module``'s stack of running site modes (innermost last), a plain attribute it holds."""
    if not has_instance_attribute(module, "dal_site_modes"):
        object.__setattr__(module, "dal_site_modes", [])
    return module.dal_site_modes


def _enter(module, args):
    mode = _SiteMode(module, getattr(module, "dal_site_path", ""))
    _running_modes(module).append(mode)
    mode.__enter__()


def _exit(module, args, output):
    modes = _running_modes(module)
    if modes:
        modes.pop().__exit__(None, None, None)
    return None


def discover(model: nn.Module, owners: list[str], run, flow: Optional[list] = None, on_result=None) -> list[Site]:
    """Run ``run()`` (one float forward) with a recording mode around each owner's forward;
    return every classified call site of the owners' own code, in call order. With ``flow`` (a
    list), every torch call of the owners' code is appended to it as a :class:`Call`, in order;
    with ``on_result``, ``on_result(site path, result)`` is called for each call of a site that
    gets a QAT module's kind (``+ * @ cat``, ...)."""
    record: dict = {}
    handles = []

    def pre(module, args, path):
        mode = _SiteMode(module, path, record, flow, on_result)
        _running_modes(module).append(mode)
        mode.__enter__()

    for path in owners:
        mod = model.get_submodule(path) if path else model
        handles.append(mod.register_forward_pre_hook(lambda m, a, p=path: pre(m, a, p)))
        handles.append(mod.register_forward_hook(_exit, always_call=True))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return list(record.values())


def install(model: nn.Module, site: Site, qmod: nn.Module) -> None:
    """Put ``qmod`` at ``site`` (``owner.dal_sites[key]``) and hook the owner (once)."""
    owner = model.get_submodule(site.owner) if site.owner else model
    sites = getattr(owner, SITES_ATTR, None)
    if sites is None:
        sites = nn.ModuleDict()
        owner.add_module(SITES_ATTR, sites)
        owner.dal_site_path = site.owner
        owner.register_forward_pre_hook(_enter)
        owner.register_forward_hook(_exit, always_call=True)
    sites[site.key] = qmod
