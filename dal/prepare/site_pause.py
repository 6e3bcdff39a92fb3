"""An owner's call-site mode (``call_sites._SiteMode``) steps off the stack while a submodule runs.

Nothing a submodule's forward calls is a call site of its owner: the mode keeps only calls made
from the owner's own forward code (and plain helper functions it reaches), and every submodule
call passes through ``nn.Module.__call__`` (torch's code, which ends the search for the owner's
frame). Yet while the mode is on torch's function-mode stack, each torch call the submodule
makes (its quantizers' tensor queries, views, the kernel calls: hundreds per forward) first goes
through the mode's Python ``__torch_function__``, about a microsecond each, only to be passed on.

So each direct submodule of an owner (the elements of a ``ModuleList`` / ``ModuleDict`` child
too; not ``dal_sites``, whose modules run inside the mode's own handler, where torch has already
taken the mode off) gets a forward pre-hook that takes the owner's running mode off the stack
(``TorchFunctionMode.__exit__``) and a forward hook (``always_call=True``) that puts it back
(``__enter__``): the mode moves by torch's public ``TorchFunctionMode`` API only. It is taken off
only when it is the top of the stack, which its :meth:`~dal.prepare.call_sites._SiteMode.on_top`
probe tells (a mode the forward entered itself, e.g. ``with torch.device(...)``, stays where it
is, and so does ours: the call then goes through the mode as before).

Left alone (the mode stays on): a submodule that runs the owner's own forward code (the owner's
class nested in itself: its calls are the owner's sites), and one holding a torch module whose
fused eval path depends on the mode (:data:`MODE_SENSITIVE`: ``nn.MultiheadAttention`` and
``nn.TransformerEncoder(Layer)`` take their native kernels only where ``has_torch_function`` is
false, which the owner's mode made true), so that their numbers stay as they were. The decorator
wrappers of a forward (transformers' ``deprecate_kwarg`` wraps both a decoder layer's and its
attention's) are not compared: shared code that makes no routed call.

Which calls the mode routes does not change, so no output, gradient or quantizer state changes;
only the number of calls that reach Python does (examples/bev's deformable block, one QAT
forward: 670 -> 84, its own 80 and 4 probes; bench/llm_npu.py's integer-model decode step prepared
with example_inputs: 780 -> 24, the 8 residual adds and 16 probes).
"""
from __future__ import annotations

from torch import nn

#: the attribute of an owner that lists the callees it leaves alone
ALONE_ATTR = "dal_site_alone"
#: torch modules that choose a fused path by ``torch.overrides.has_torch_function``: a callee holding
#: one keeps the owner's mode (module doc)
MODE_SENSITIVE = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)


class _Pause:
    """The pre-hook / hook pair of one submodule for one owner (its attribute ``modes_key`` is the
    owner's stack of running modes, innermost last)."""

    def __init__(self, owner: nn.Module, modes_key: str):
        self.owner, self.modes_key, self.taken = owner, modes_key, []

    def before(self, module, args):
        modes = getattr(self.owner, self.modes_key, None)
        mode = modes[-1] if modes else None
        if mode is not None and not mode.paused and mode.on_top():
            mode.__exit__(None, None, None)
            mode.paused = True
        else:
            mode = None
        self.taken.append(mode)

    def after(self, module, args, output):
        mode = self.taken.pop() if self.taken else None
        if mode is not None:
            mode.__enter__()
            mode.paused = False


def _callees(owner: nn.Module, skip: str):
    """The modules the owner's forward can call directly: its children but ``skip``, a
    ``ModuleList`` / ``ModuleDict`` child replaced by its elements (recursively)."""
    todo = [m for name, m in owner.named_children() if name != skip]
    while todo:
        m = todo.pop(0)
        if type(m) in (nn.ModuleList, nn.ModuleDict):
            todo[:0] = list(m.children())
        else:
            yield m


def pause_callees(owner: nn.Module, codes_of, skip: str, modes_key: str) -> None:
    """Hook each module the owner's forward calls (:func:`_callees`) once: while it runs, the
    owner's running mode is off the stack (module doc). ``codes_of(module)``: the code objects of
    a module's forward body (call_sites ``_body_codes``); a callee with a module in its subtree
    whose body code is the owner's, or a :data:`MODE_SENSITIVE` one, is left alone (listed in
    ``owner.dal_site_alone``). Called at
    each routed forward: a callee without its hooks (one dal.convert swapped in, or a deep copy
    of a ``GraphModule``, which drops forward hooks) gets them then."""
    alone = getattr(owner, ALONE_ATTR, None)
    if alone is None:
        alone = []
        setattr(owner, ALONE_ATTR, alone)
    body = None
    for m in _callees(owner, skip):
        if _hooked(m, owner) or any(a is m for a in alone):
            continue
        body = codes_of(owner) if body is None else body
        if any(isinstance(sub, MODE_SENSITIVE) or codes_of(sub) & body for sub in m.modules()):
            alone.append(m)  # the owner's own code runs inside (its calls are sites), or a fused path
            continue
        p = _Pause(owner, modes_key)
        m.register_forward_pre_hook(p.before, prepend=True)
        m.register_forward_hook(p.after, always_call=True)


def _hooked(m: nn.Module, owner: nn.Module) -> bool:
    """``m`` has the pause hooks of ``owner`` (both of them): read from nn.Module's hook tables, torch
    having no public query (a deep-copied GraphModule keeps its attributes but not its hooks)."""
    def has(hooks):
        return any(isinstance(getattr(h, "__self__", None), _Pause) and h.__self__.owner is owner for h in hooks.values())
    return has(m._forward_pre_hooks) and has(m._forward_hooks)
