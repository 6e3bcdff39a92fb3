"""House rule: a private member is reached only by its owner, read from the AST of every file in dal/.

Flagged, each as ``file:line: expression``:

- ``x._name`` (one leading underscore, not a dunder) where ``x`` is not ``self``, ``cls`` or
  ``super()``, and ``_name`` is an attribute dal itself defines (``<obj>._name = ...``,
  ``setattr(<obj>, "_name", ...)``, a ``_name`` method or class attribute of a dal class), unless
  the same file defines it: a module may reach its own classes' privates; the same for
  ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr(x, "_name")`` and ``object.__setattr__(x, "_name", ...)``;
- ``x._name`` where ``_name`` is a private member of ``torch.nn.Module`` (its subclasses in
  ``torch.nn``) or ``torch.Tensor``, unless ``TORCH_INTERNALS`` allows that name in that file
  (members with no public equivalent, each with its reason);
- ``x.__dict__`` and ``vars(x)`` for any ``x`` but ``self`` / ``cls``: reading or writing another
  object's attribute table behind its back.

Attributes of an imported module (``torch._C``, ``nn.modules.batchnorm._BatchNorm``) are another
library's business and not flagged, unless the name is a dal-defined private (an imported dal
class's private member is still its own).
"""
import ast
from pathlib import Path

import torch
from torch import nn

import dal

ROOT = Path(dal.__file__).parent
SELF_NAMES = ("self", "cls")

#: torch internals with no public equivalent: name -> (why, the files that may reach it);
#: ``__dict__`` stands for ``x.__dict__`` and ``vars(x)`` both.
TORCH_INTERNALS = {
    "_modules": ("a submodule slot read or written as nn.Module keeps it: None slots included (named_children "
                 "skips them), not through __setattr__ (GraphModule and user classes override it), its place "
                 "among siblings kept", ("dal/nn/tree.py",)),
    "_parameters": ("a module's own parameter slots, None slots included (named_parameters skips them)",
                    ("dal/nn/tree.py",)),
    "_buffers": ("a module's own buffer slots, None slots included (named_buffers skips them)",
                 ("dal/nn/tree.py",)),
    "_version": ("a tensor's in-place version counter, which tells a cache its tensor changed: torch has no "
                 "public accessor", ("dal/convert/quant_calls.py", "dal/convert/matmul_f64.py",
                                     "dal/sparsity/controller.py")),
    "_conv_forward": ("nn.Conv*'s convolution with a weight other than its own, padding_mode included: no "
                      "public method takes the weight", ("dal/ptq/layers.py", "dal/convert/float_layers.py")),
    "_forward_pre_hooks": ("whether a module has forward pre-hooks (or a given one): torch has no public query",
                           ("dal/nn/fast_path.py", "dal/prepare/fp16_island.py")),
    "_forward_hooks": ("whether a module has forward hooks: torch has no public query",
                       ("dal/prepare/fp16_island.py",)),
    "__dict__": ("a module's attribute table as a whole: a copy with tables of its own and instance attributes "
                 "(dal.nn.tree), a class swap that keeps every attribute (dal.nn.adopt), fx tracing that shadows "
                 "forward / training on instances and puts the table back exactly (dal.nn.own_forward)",
                 ("dal/nn/tree.py", "dal/nn/adopt.py", "dal/nn/own_forward.py")),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def torch_private_names() -> set:
    """Private member names of ``nn.Module`` (class and a fresh instance), of every module class
    in ``torch.nn``, and of ``torch.Tensor``."""
    names = set(vars(nn.Module())) | set(dir(torch.Tensor))
    for obj in vars(nn).values():
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            names |= set(dir(obj))
    return {n for n in names if _is_private(n)}


def _imported_names(tree: ast.AST) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def defined_private_names(tree: ast.AST) -> set:
    """The private attribute names a source defines: stored as ``<obj>._name``, set with
    ``setattr(<obj>, "_name", ...)``, or a method / class attribute ``_name`` of a class."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(stmt.name)
                targets = (stmt.targets if isinstance(stmt, ast.Assign)
                           else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else [])
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return {n for n in names if _is_private(n)}


def _root_name(node: ast.AST):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_owner(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in SELF_NAMES
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _attr_by_name(node: ast.AST):
    """``(obj, name)`` for ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr(obj, "name", ...)``
    and ``object.__setattr__`` / ``__getattribute__`` / ``__delattr__(obj, "name", ...)``, else None."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    func, name = node.func, node.args[1]
    by_builtin = isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr")
    by_object = (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "object"
                 and func.attr in ("__setattr__", "__getattribute__", "__delattr__"))
    if (by_builtin or by_object) and isinstance(name, ast.Constant) and isinstance(name.value, str):
        return node.args[0], name.value
    return None


def violations(trees: dict, torch_names: set):
    """``(file, line, expression, why)`` for every reach into another owner's private members in
    ``trees`` (file -> parsed source); the rules are the module docstring's."""
    defined = {path: defined_private_names(tree) for path, tree in trees.items()}
    dal_names = set().union(*defined.values()) - torch_names if defined else set()

    def why_not(path, name, root, imported):
        """Why reaching ``<root...>.name`` from ``path`` breaks the rule, or None."""
        if name in torch_names and root not in imported:
            if path not in TORCH_INTERNALS.get(name, (None, ()))[1]:
                return f"torch's private {name}"
        elif name in dal_names and name not in defined[path]:
            return f"private {name} of {', '.join(sorted(p for p, names in defined.items() if name in names))}"
        return None

    for path, tree in trees.items():
        imported = _imported_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_owner(node.value):
                why = why_not(path, node.attr, _root_name(node.value), imported)
                if why:
                    yield path, node.lineno, ast.unparse(node), why
            elif (by_name := _attr_by_name(node)) is not None:
                obj, name = by_name
                why = why_not(path, name, _root_name(obj), imported) if _is_private(name) and not _is_owner(obj) else None
                if why:
                    yield path, node.lineno, ast.unparse(node), why
            if path in TORCH_INTERNALS["__dict__"][1]:
                continue
            elif isinstance(node, ast.Attribute) and node.attr == "__dict__" and not _is_owner(node.value):
                yield path, node.lineno, ast.unparse(node), "another object's __dict__"
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"
                  and node.args and not _is_owner(node.args[0])):
                yield path, node.lineno, ast.unparse(node), "another object's vars()"


def _dal_trees() -> dict:
    return {str(p.relative_to(ROOT.parent)): ast.parse(p.read_text(), filename=str(p))
            for p in sorted(ROOT.rglob("*.py"))}


def test_private_members_are_reached_only_by_their_owner():
    found = list(violations(_dal_trees(), torch_private_names()))
    offenders = [f"{path}:{line}: {expr} ({why})" for path, line, expr, why in found]
    assert not offenders, "private members reached from outside their owner:\n" + "\n".join(offenders)


def test_the_allowlist_names_torch_internals_with_reasons():
    torch_names = torch_private_names()
    for name, (why, files) in TORCH_INTERNALS.items():
        assert name in torch_names or name == "__dict__", f"{name} is not a private member of nn.Module or Tensor"
        assert why.strip() and files, f"{name}: give a reason and the files that may reach it"
        assert all((ROOT.parent / f).is_file() for f in files), f"{name}: {files} names a missing file"


def test_a_planted_violation_is_found():
    owner = ast.parse(
        "class Q:\n"
        "    _LIMIT = 3\n"
        "    def __init__(self):\n"
        "        self._kernel = None\n"
        "        self.fmt = 'int8'\n"
        "    def _step(self):\n"
        "        return self._kernel, Q._LIMIT\n"
        "def own(q):\n"
        "    return q._kernel\n")  # the same file: its own class's private
    user = ast.parse(
        "import torch\n"
        "from m import Q\n"
        "class P(torch.nn.Module):\n"
        "    def forward(self, q, o, t):\n"
        "        super()._load_from_state_dict\n"
        "        self._private_of_p = 1\n"
        "        torch._C\n"
        "        a = q._kernel\n"
        "        b = o.__dict__['fmt']\n"
        "        vars(o)['fmt'] = 'fp8'\n"
        "        c = Q._LIMIT\n"
        "        q._step()\n"
        "        t._version\n"
        "        getattr(q, '_kernel', None)\n"
        "        object.__setattr__(t, '_buffers', {})\n"
        "        object.__setattr__(self, '_buffers', {})\n"
        "        getattr(o, '_not_dal', None)\n"
        "        return self._private_of_p, vars(self)\n")
    found = {(path, expr) for path, _, expr, _ in violations({"m.py": owner, "u.py": user}, torch_private_names())}
    assert found == {("u.py", "q._kernel"), ("u.py", "o.__dict__"), ("u.py", "vars(o)"),
                     ("u.py", "Q._LIMIT"), ("u.py", "q._step"), ("u.py", "t._version"),
                     ("u.py", "getattr(q, '_kernel', None)"), ("u.py", "object.__setattr__(t, '_buffers', {})")}
