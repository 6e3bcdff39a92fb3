"""House rule: a private member is reached only by its owner, read from the AST of every file in dal/.

A file *defines* a private name (``_name``, one leading underscore, not a dunder) when one of its
classes has it as a method, nested class or class attribute, when it stores it on ``self`` / ``cls``
(``self._name = ...``, ``setattr(self, "_name", ...)``, ``object.__setattr__(self, "_name", ...)``),
or when it is one of the file's top-level names. The file is the unit of privacy, as Python's
underscore convention has it: a file may reach its own classes' privates on any object.

Flagged, each as ``file:line: expression (why)``, for an object ``x`` that is not ``self``, ``cls``
or ``super()``; the member is reached as ``x._name``, ``getattr`` / ``hasattr`` / ``setattr`` /
``delattr(x, NAME)`` or ``object.__setattr__`` / ``__getattribute__`` / ``__delattr__(x, NAME)``,
NAME a string literal or a top-level constant of the file that holds one:

- ``_name`` defined by another file of dal and not by this one (another module's private member:
  make it public and document it, or move the code into the owning class);
- ``_name`` that dal does not define at all: a member of torch, transformers or the standard library,
  or a marker dal sets on someone else's object (``p._dal_hooked = True``: a marker is a documented
  public attribute, a ``WeakKeyDictionary`` or a member of dal's own class), unless
  ``FOREIGN_INTERNALS`` allows that name in that file (members with no public equivalent, each
  with its reason: the list is the documentation; a new use fails until it is listed);
- ``x.__dict__``, ``vars(x)`` and ``getattr(x, "__dict__")``: reading or writing another object's
  attribute table behind its back, unless ``FOREIGN_INTERNALS["__dict__"]`` lists the file.

The same holds for another library's private functions and classes: a private attribute of an
imported module (``torch._C``, ``nn.modules.batchnorm._BatchNorm``) and a private name imported
from outside dal (``from torch.nn.modules.batchnorm import _BatchNorm``) need their
``FOREIGN_INTERNALS`` entry (tests/test_training_path_rules.py refuses ``torch._*`` in the training
path on top of this). The owner is found by name, not by type: a name this file defines counts as
its own on any object.
"""
import ast
from pathlib import Path

import torch
from torch import nn

import dal

ROOT = Path(dal.__file__).parent
SELF_NAMES = ("self", "cls")

#: private members of other libraries' objects with no public equivalent: name -> (why, the files
#: that may reach it); ``__dict__`` stands for ``x.__dict__``, ``vars(x)`` and ``getattr(x, "__dict__")``.
#: DESIGN.md refuses private torch internals in the training path (dal/quantizer*.py, formats,
#: observers, nn, prepare, calibration, sparsity, kernels): an entry there is read-only or runs when
#: a model is prepared, not in a step, and its reason says which.
FOREIGN_INTERNALS = {
    "_modules": ("a submodule slot read or written as nn.Module keeps it: None slots included (named_children "
                 "skips them), not through __setattr__ (GraphModule and user classes override it), its place "
                 "among siblings kept", ("dal/nn/tree.py",)),
    "_parameters": ("a module's own parameter slots, None slots included (named_parameters skips them)",
                    ("dal/nn/tree.py",)),
    "_buffers": ("a module's own buffer slots, None slots included (named_buffers skips them)",
                 ("dal/nn/tree.py",)),
    "_version": ("a tensor's in-place version counter, which tells a cache its tensor changed: torch has no "
                 "public accessor", ("dal/convert/quant_calls.py", "dal/convert/matmul_f64.py", "dal/convert/codes_boundary.py",
                                     "dal/sparsity/controller.py")),
    "_conv_forward": ("nn.Conv*'s convolution with a weight other than its own, padding_mode included: no "
                      "public method takes the weight", ("dal/ptq/layers.py", "dal/convert/float_layers.py")),
    "_forward_pre_hooks": ("whether a module has forward pre-hooks (or a given one): torch has no public query",
                           ("dal/nn/fast_path.py", "dal/prepare/fp16_island.py")),
    "_forward_hooks": ("whether a module has forward hooks: torch has no public query",
                       ("dal/prepare/fp16_island.py",)),
    "__dict__": ("a module's attribute table as a whole: a copy with tables of its own and instance attributes "
                 "(dal.nn.tree), a class swap that keeps every attribute (dal.nn.adopt), fx tracing that shadows "
                 "forward / training on instances and puts the table back exactly (dal.nn.own_forward)"
                 "; a prepared model's handle found on any object (a wrapper, a LightningModule) without "
                 "nn.Module.__getattr__ (dal.prepare.handle)",
                 ("dal/nn/tree.py", "dal/nn/adopt.py", "dal/nn/own_forward.py", "dal/prepare/handle.py")),
    "_attn_implementation": ("transformers' configuration switch of the attention implementation, which its "
                             "attention interface reads: a built model has no public setter that takes dal's "
                             "registered implementation for one layer's shared config; set when a model is prepared",
                             ("dal/replace/hf_attention.py",)),
    "_fields": ("a namedtuple's field names: namedtuple's public API is underscored", ("dal/nest.py",)),
    "_global_forward_hooks": ("read only, whether torch's global module hooks are set (torch.nn.modules.module; "
                              "no public query): an FP16 island takes its fused path only without them",
                              ("dal/prepare/fp16_island.py",)),
    "_global_forward_pre_hooks": ("as _global_forward_hooks", ("dal/prepare/fp16_island.py",)),
    "_BatchNorm": ("torch's base class of every BatchNorm*d (isinstance), the type torch's own code tests; "
                   "read when calibrating / reporting, not in a step",
                   ("dal/analysis/layerwise.py", "dal/calibration/bn_stats.py")),
    "_ConvNd": ("torch's base class of every Conv*d / ConvTranspose*d (isinstance); the cost model",
                ("dal/cost/torch_graph.py",)),
    "_C": ("torch._C.DisableTorchFunction (the integer model's forms run without torch-function dispatch: "
           "dal.convert) and torch._C._GLIBCXX_USE_CXX11_ABI (the ABI the NPU reference's C++ build must "
           "match: build time); neither in the training path", ("dal/convert/quant_calls.py", "dal/npu/build.py")),
    "_GLIBCXX_USE_CXX11_ABI": ("as _C, in the NPU reference's build", ("dal/npu/build.py",)),
    "_maybe_get_const": ("torch.onnx.symbolic_helper, the TorchScript exporter's helpers that its custom "
                         "symbolics are written with (export only)", ("dal/export/symbolics.py",)),
    "_get_const": ("as _maybe_get_const", ("dal/export/symbolics.py",)),
    "_is_constant": ("as _maybe_get_const", ("dal/export/symbolics.py",)),
    "_is_none": ("as _maybe_get_const", ("dal/export/symbolics.py",)),
    "_DEFAULT_REWRITE_RULES": ("onnxscript's default rewrite rules, which torch.onnx.export(optimize=True) runs: the "
                               "dynamo route runs them less two (Flatten -> Reshape, an all-zero bias removed), "
                               "which no public API allows (export only; an onnxscript upgrade may move them)",
                               ("dal/export/dynamo_trace.py",)),
    "_constant_folding": ("onnxscript's constant-folding pass and its size limits, as optimize=True runs it "
                          "(export only)", ("dal/export/dynamo_trace.py",)),
    "_basic_rules": ("the Flatten -> Reshape rule, to leave it out (export only)", ("dal/export/dynamo_trace.py",)),
    "_remove_optional_bias": ("the all-zero-bias removal rules, to leave them out (export only)",
                              ("dal/export/dynamo_trace.py",)),
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


def _string_constants(tree: ast.AST) -> dict:
    """A file's top-level ``NAME = "string"`` assignments: attribute names held in constants."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def top_level_private_names(tree: ast.AST) -> set:
    """The private names a source defines at top level (functions, classes, variables)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names |= {t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                      if isinstance(t, ast.Name)}
    return {n for n in names if _is_private(n)}


def member_private_names(tree: ast.AST) -> set:
    """The private members a source's classes define (module doc): methods, nested classes and
    class attributes, and what it stores on ``self`` / ``cls`` / ``super()``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(stmt.name)
                targets = (stmt.targets if isinstance(stmt, ast.Assign)
                           else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else [])
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_owner(node.value):
            names.add(node.attr)
    constants = _string_constants(tree)
    names |= {name for obj, name in filter(None, (_attr_by_name(n, constants) for n in ast.walk(tree)))
              if _is_owner(obj)}
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


def _attr_by_name(node: ast.AST, constants: dict):
    """``(obj, name)`` for ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr(obj, NAME, ...)``
    and ``object.__setattr__`` / ``__getattribute__`` / ``__delattr__(obj, NAME, ...)``, NAME a
    string literal or a name ``constants`` maps to one, else None."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    func, arg = node.func, node.args[1]
    by_builtin = isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr", "delattr")
    by_object = (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "object"
                 and func.attr in ("__setattr__", "__getattribute__", "__delattr__"))
    if not (by_builtin or by_object):
        return None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return node.args[0], arg.value
    if isinstance(arg, ast.Name) and arg.id in constants:
        return node.args[0], constants[arg.id]
    return None


def _reaches(tree: ast.AST):
    """``(line, obj, name, expression)`` of every attribute reached by name (module doc's forms)."""
    constants = _string_constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.value, node.attr, node
        elif (by_name := _attr_by_name(node, constants)) is not None:
            yield node.lineno, by_name[0], by_name[1], node
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
            yield node.lineno, node.args[0], "__dict__", node


def violations(trees: dict, torch_names: set):
    """``(file, line, expression, why)`` for every reach into another owner's private members in
    ``trees`` (file -> parsed source); the rules are the module docstring's. ``torch_names``: the
    private members of nn.Module and Tensor, which no file of dal owns by storing them on ``self``."""
    members = {path: member_private_names(tree) - torch_names for path, tree in trees.items()}
    tops = {path: top_level_private_names(tree) for path, tree in trees.items()}

    def owners(name, tables):
        return sorted(path for table in tables for path, names in table.items() if name in names)

    def why_not(path, name, obj, imported):
        """Why reaching ``obj.name`` from ``path`` breaks the rule, or None."""
        if name == "__dict__":
            return None if path in FOREIGN_INTERNALS["__dict__"][1] else "another object's attribute table"
        if not _is_private(name) or name in members[path] or name in tops[path]:
            return None
        of_module = _root_name(obj) in imported and isinstance(obj, (ast.Name, ast.Attribute))
        # a module's (or an imported class's) attribute: dal's top-level privates count as owners too
        found = owners(name, (members, tops) if of_module else (members,))
        if found:
            return f"private {name} of {', '.join(sorted(set(found)))}"
        if path in FOREIGN_INTERNALS.get(name, (None, ()))[1]:
            return None
        owner = ("another library's private" if of_module else
                 "torch's private" if name in torch_names else "a private member dal does not define")
        return f"{owner} {name}, not allowed here by FOREIGN_INTERNALS"

    for path, tree in trees.items():
        imported = _imported_names(tree)
        for line, obj, name, node in _reaches(tree):
            why = why_not(path, name, obj, imported) if not _is_owner(obj) else None
            if why:
                yield path, line, ast.unparse(node), why
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] != "dal":
                for alias in node.names:
                    if _is_private(alias.name) and path not in FOREIGN_INTERNALS.get(alias.name, (None, ()))[1]:
                        yield (path, node.lineno, f"from {node.module} import {alias.name}",
                               f"another library's private {alias.name}, not allowed here by FOREIGN_INTERNALS")


def _dal_trees() -> dict:
    return {str(p.relative_to(ROOT.parent)): ast.parse(p.read_text(), filename=str(p))
            for p in sorted(ROOT.rglob("*.py"))}


def test_private_members_are_reached_only_by_their_owner():
    found = list(violations(_dal_trees(), torch_private_names()))
    offenders = [f"{path}:{line}: {expr} ({why})" for path, line, expr, why in found]
    assert not offenders, "private members reached from outside their owner:\n" + "\n".join(offenders)


def test_the_allowlist_names_foreign_internals_with_reasons():
    """Each entry has a reason, names files of dal that reach it on another object (no stale
    entry), and is no private name dal itself defines (those are refused, not listed)."""
    trees = _dal_trees()
    dal_members = set().union(*(member_private_names(tree) for tree in trees.values())) - torch_private_names()
    for name, (why, files) in FOREIGN_INTERNALS.items():
        assert why.strip() and files, f"{name}: give a reason and the files that may reach it"
        assert name == "__dict__" or (_is_private(name) and name not in dal_members), \
            f"{name}: not another library's private member"
        for f in files:
            assert f in trees, f"{name}: {f} is not a file of dal"
            reached = {n for _, obj, n, _ in _reaches(trees[f]) if not _is_owner(obj)}
            reached |= {a.name for node in ast.walk(trees[f]) if isinstance(node, ast.ImportFrom) for a in node.names}
            assert name in reached, f"{name}: {f} no longer reaches it; remove it from FOREIGN_INTERNALS"


def test_a_planted_violation_is_found():
    owner = ast.parse(
        "class Q:\n"
        "    _LIMIT = 3\n"
        "    def __init__(self):\n"
        "        self._kernel = None\n"
        "        self.fmt = 'int8'\n"
        "    def _step(self):\n"
        "        return self._kernel, Q._LIMIT\n"
        "HOOKED = '_dal_hooked'\n"
        "def _helper():\n"
        "    pass\n"
        "def own(q, p, b):\n"
        "    b._dal_masked = True\n"  # a marker on someone else's object: refused, same file or not
        "    object.__setattr__(p, HOOKED, True)\n"
        "    return q._kernel\n")  # the same file: its own class's private
    user = ast.parse(
        "import torch\n"
        "import m\n"
        "from m import Q\n"
        "from torch.nn.modules.conv import _ConvNd\n"
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
        "        m._helper()\n"
        "        o.config._attn_implementation\n"
        "        return self._private_of_p, vars(self)\n")
    found = {(path, expr) for path, _, expr, _ in violations({"m.py": owner, "u.py": user}, torch_private_names())}
    assert found == {("u.py", "q._kernel"), ("u.py", "o.__dict__"), ("u.py", "vars(o)"),
                     ("u.py", "Q._LIMIT"), ("u.py", "q._step"), ("u.py", "t._version"),
                     ("u.py", "getattr(q, '_kernel', None)"), ("u.py", "object.__setattr__(t, '_buffers', {})"),
                     ("u.py", "getattr(o, '_not_dal', None)"), ("u.py", "m._helper"),
                     ("u.py", "o.config._attn_implementation"), ("u.py", "torch._C"),
                     ("u.py", "from torch.nn.modules.conv import _ConvNd"),
                     ("m.py", "b._dal_masked"), ("m.py", "object.__setattr__(p, HOOKED, True)")}
