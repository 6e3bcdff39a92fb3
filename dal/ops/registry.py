"""The op registry: every :class:`~dal.ops.op.Op` dal knows, from the family files of this
package and from users (:func:`register`), with the lookups prepare, export, convert and cost use.

The family files are imported on the first lookup, not by ``import dal``. A float pattern (a
function, a Tensor method name, a module type) belongs to at most one op: registering a second
op that claims it raises, naming both.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

from .op import Op

#: the family files, one per op family (dal/ops/<family>.py, each with ``OPS``: a tuple of Op)
FAMILIES = ("weighted", "binary", "reshape", "normalization", "activations", "pooling",
            "attention", "islands", "sampling", "indexing", "host")

_OPS: dict[str, Op] = {}
_BY_FUNCTION: dict[Any, Op] = {}
_BY_METHOD: dict[str, Op] = {}
_BY_MODULE: dict[type, Op] = {}
_LOADED: list[bool] = []
_USER: set[str] = set()  # names of the ops register() added (unregister may remove them)
_VERSION: list[int] = [0]  # bumped by every registration and removal (see version())


def _load() -> None:
    if _LOADED:
        return
    _LOADED.append(True)
    for family in FAMILIES:
        for op in importlib.import_module(f"{__package__}.{family}").OPS:
            _add(op, f"dal/ops/{family}.py")


def _add(op: Op, origin: str, user: bool = False) -> Op:
    if not isinstance(op, Op):
        raise TypeError(f"{origin}: dal.ops registers Op instances, got {type(op).__name__}")
    if op.name in _OPS and _OPS[op.name] is not op:
        raise ValueError(f"{origin}: an op named {op.name!r} is already registered")
    claims = ([(_BY_FUNCTION, f, f"function {getattr(f, '__qualname__', f)!r}") for f in op.functions]
              + [(_BY_METHOD, m, f"Tensor method {m!r}") for m in op.methods]
              + [(_BY_MODULE, t, f"module type {t.__qualname__}") for t in op.modules])
    for table, key, what in claims:
        other = table.get(key)
        if other is not None and other.name != op.name:
            raise ValueError(f"{origin}: op {op.name!r} claims {what}, which op {other.name!r} already matches")
    _OPS[op.name] = op
    for table, key, _ in claims:
        table[key] = op
    if user:
        _USER.add(op.name)
    _VERSION[0] += 1
    return op


def register(op_or_type=None, **fields) -> Any:
    """Register an operator with every stage of dal (prepare, export, convert, cost).

    - ``register(Op(...))`` registers the op and returns it;
    - ``@register(MyModule, op_class=..., onnx=..., cost=..., ...)`` on a QAT class registers an
      op matching the float module type ``MyModule`` whose QAT module is the decorated class
      (``handling="quantize"``, ``name`` defaults to the type's name, ``op_class`` to
      ``"custom"``); the remaining keyword arguments are :class:`Op` fields. The class needs
      ``from_float(mod, spec, name)`` and ``to_float()`` (``dal.nn.QATModule`` gives both).
      Returns the class.

    A pattern (function, method, module type) already matched by another op is refused, naming
    both ops; so is a second op of the same name. :func:`unregister` removes a user's op.
    """
    if isinstance(op_or_type, Op):
        if fields:
            raise TypeError(f"register(Op) takes no keyword fields, got {sorted(fields)}")
        _load()
        return _add(op_or_type, "dal.ops.register", user=True)
    if not isinstance(op_or_type, type):
        raise TypeError(f"dal.ops.register takes an Op or a float module type, got {op_or_type!r}")
    float_type = op_or_type

    def wrap(cls):
        where = f"dal.ops.register({float_type.__qualname__})"
        missing = [m for m in ("from_float", "to_float") if not callable(getattr(cls, m, None))]
        if not isinstance(cls, type) or missing:
            raise TypeError(f"{where}: decorates a QAT class with from_float / to_float (derive it from "
                            f"dal.nn.QATModule); {getattr(cls, '__name__', cls)!r} lacks {', '.join(missing) or 'a type'}")
        fields.setdefault("name", float_type.__name__)
        fields.setdefault("handling", "quantize")
        fields.setdefault("op_class", "custom")
        _load()
        _add(Op(modules=(float_type,), qat_module=cls, **fields), where, user=True)
        return cls
    return wrap


def unregister(name: str) -> Op:
    """Remove the user's op ``name`` (registered by :func:`register`) and its patterns; return it.

    The family files' ops cannot be removed (ValueError); an unknown name is a KeyError. The
    :func:`version` changes, so tables derived from the registry are rebuilt on their next use;
    a model already prepared keeps the QAT modules it was given. For tests and sessions that
    register an op for a while (``try: ... finally: dal.ops.unregister("ClampScale")``)."""
    op = get(name)
    if name not in _USER:
        raise ValueError(f"op {name!r} is declared by a dal/ops family file; only ops added by "
                         f"dal.ops.register can be unregistered")
    _USER.discard(name)
    _VERSION[0] += 1
    del _OPS[name]
    for table in (_BY_FUNCTION, _BY_METHOD, _BY_MODULE):
        for key in [k for k, v in table.items() if v is op]:
            del table[key]
    return op


def get(name: str) -> Op:
    """The op named ``name``; KeyError listing near names when there is none."""
    _load()
    try:
        return _OPS[name]
    except KeyError:
        from difflib import get_close_matches

        near = get_close_matches(name, list(_OPS), n=3)
        raise KeyError(f"no op named {name!r} in dal.ops" + (f" (did you mean {', '.join(near)}?)" if near else ""))


def version() -> int:
    """A number that changes whenever an op is registered or unregistered (the families loaded
    first): a stage that caches a table derived from the registry keys the cache on it, so that
    a user's op registered later is seen (``functools.cache`` on ``f(version())``)."""
    _load()
    return _VERSION[0]


def all_ops() -> tuple[Op, ...]:
    """Every registered op, in registration order (the families', then users')."""
    _load()
    return tuple(_OPS.values())


def select(**criteria) -> tuple[Op, ...]:
    """The ops whose fields equal every ``criteria`` value (a tuple value: any of its members),
    e.g. ``select(handling="functional")``, ``select(op_class=("add", "mul"))``."""
    def matches(op):
        for field, want in criteria.items():
            have = getattr(op, field)
            if have != want and not (isinstance(want, tuple) and have in want):
                return False
        return True
    return tuple(op for op in all_ops() if matches(op))


def by_function(fn: Callable) -> Optional[Op]:
    """The op a torch callable belongs to, or None."""
    _load()
    try:
        return _BY_FUNCTION.get(fn)
    except TypeError:  # an unhashable target
        return None


def by_method(name: str) -> Optional[Op]:
    """The op a Tensor method name (``"add_"``, ``"__radd__"``) belongs to, or None."""
    _load()
    return _BY_METHOD.get(name)


def by_module(module_type: type) -> Optional[Op]:
    """The op matching exactly this float module type, or None."""
    _load()
    return _BY_MODULE.get(module_type)


def by_call(kind: str, target) -> Optional[Op]:
    """The op a call names, as an fx node states it: ``kind`` ``"call_function"`` (``target`` a
    callable), ``"call_method"`` (a Tensor method name) or ``"call_module"`` (``target`` the
    module's type); None for another kind or a target no op matches."""
    if kind == "call_function":
        return by_function(target)
    if kind == "call_method":
        return by_method(target)
    if kind == "call_module":
        return by_module(target)
    return None


def functions_of(*ops: Op) -> frozenset:
    """Every function of ``ops`` (a derived table: ``functions_of(*select(handling="functional"))``)."""
    return frozenset(f for op in ops for f in op.functions)


def methods_of(*ops: Op) -> frozenset:
    """Every Tensor method name of ``ops``."""
    return frozenset(m for op in ops for m in op.methods)


def modules_of(*ops: Op) -> tuple:
    """Every module type of ``ops``, in declaration order."""
    return tuple(t for op in ops for t in op.modules)
