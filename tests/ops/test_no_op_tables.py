"""No table of op names outside dal/ops (issue 41): the registry declares each operator once.

An *op-name table* is a literal set, frozenset, tuple, list or dict (its keys), or the right side
of an ``in`` test, in a module of dal/, with two or more members that name registered operators:
op names or Tensor method names of ``dal.ops`` entries (``"add"``, ``"__radd__"``), or torch
callables / module types an entry matches (``torch.add``, ``F.relu``, ``nn.Conv2d``). Such a
table is derived from the registry instead (``dal.ops.select``, ``functions_of``, an Op field).

Out of scope: dal/ops declares the ops; dal/npu is the independent reference; ONNX node types
(``"Conv"``, ``"Add"``) are the ONNX standard's vocabulary, which the files that read or rewrite
ONNX (verification, export's graph passes, the CLI) name for the node semantics they implement.
``ALLOWED`` lists the tables that only look like op tables, each with its reason: the list is the
documentation, and a new table fails until it is derived or listed.
"""
import ast
import operator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dal
import dal.ops

ROOT = Path(dal.__file__).parent
EXEMPT_PACKAGES = ("ops", "npu")
#: "<file under dal/>:<table>" (an ``in`` test: "in <its members>") -> why it is not an op-name table
ALLOWED: dict[str, str] = {
    "cost/shared_groups.py:_FIRST_ONLY": "which argument of a Tensor method carries data (expand_as's shape "
                                         "donor does not): data-flow semantics of calls, read by one consumer, "
                                         "not op identity",
    "hardware/op_classes.py:OP_CLASS_ROLES": "the hardware schema's op classes and their roles (conv, add, cat ...), "
                                            "not ops: an op class groups ops; some share an op's name",
    "hardware/op_classes.py:HOST_OP_CLASS_ROLES": "as OP_CLASS_ROLES, the host op classes",
    "prepare/fp16_island.py:ISLAND_CLASSES": "op classes an FP16 island may hold (hardware vocabulary)",
    "prepare/float_ops.py:in softmax, layernorm": "op classes (hardware vocabulary, with activation)",
    "formats/island.py:OPS": "the FP16 island C kernel's op codes (its ABI); dal.formats is layer 0, below dal.ops",
    "convert/probe.py:_BOUNDS": "how dal.convert reads a Relu / Clip's bounds from a call, keyed by op name "
                                "(one consumer's semantics)",
    "convert/probe.py:_PICKERS": "dal.convert's argument check of element-picking ops, keyed by op name",
    "convert/probe.py:_NO_NODE": "the ops whose eval-mode export leaves no node (dropout, identity): dal.convert's "
                                 "reading of the exporter, keyed by op name",
    "nn/gather.py:KINDS": "the spellings of the one gather op whose arguments gather_call parses differently",
    "nn/scatter_add.py:KINDS": "the spellings of the one scatter-add op whose arguments scatter_call parses",
    "prepare/float_ops.py:_NOT_HOST_SPELLINGS": "spellings of gather / scatter_add (row gathers, index_put) that are "
                                                "no host op when left float, keyed by op name",
    "prepare/float_ops.py:_INT_RESULT_FUNCTIONS": "torch's dtype rule (an integer result) for position arithmetic, "
                                                  "mixing calls no op declares (arange, argmax)",
    "prepare/float_ops.py:_INT_RESULT_METHODS": "as _INT_RESULT_FUNCTIONS (long, int, argmax ...)",
    "prepare/float_ops.py:_INT_KEEPING": "torch's dtype rule (integer in, integer out) for position arithmetic",
    "prepare/float_ops.py:in groupnorm, instancenorm": "the hardware verdict's advice text for these two ops",
    "prepare/position_ops.py:_SHAPE_METHODS": "the value-keeping methods the position tracer follows (a narrower "
                                              "set than the reshape-like ops: no to / float / repeat / flip)",
    "prepare/deformable.py:in add, mul": "the site kinds that take the sampling role in deformable attention",
    "replace/activation_probe.py:_NOT_POINTWISE": "substrings matched against any torch call's name (conv, sum, "
                                                  "rand ...), not op identity",
    "replace/lut.py:FUNCTIONS": "the functions the LUT rule's apply_function implements (its module types come "
                                "from the registry)",
    "ptq/equalization.py:in clip, relu": "the values of equalize(relu6=...), not ops",
    "sparsity/permute.py:_ACTS": "the activations the channel-permutation search was checked against; an "
                                 "element-wise Op property would widen it (a behaviour change)",
}
_ALIASES = {"torch": torch, "F": F, "nn": nn, "operator": operator}


def _registered():
    names, objects = set(), set()
    for op in dal.ops.all_ops():
        names.add(op.name)
        names.update(op.methods)
        objects.update(id(f) for f in op.functions)
        objects.update(id(t) for t in op.modules)
    return names, objects


def _resolve(node):
    """The object an ``a.b.c`` expression names when it starts at torch / F / nn / operator."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in _ALIASES:
        return None
    obj = _ALIASES[node.id]
    for part in reversed(parts):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _members(node):
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return node.elts
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple")
            and node.args):
        return _members(node.args[0])
    return []


def _op_members(node, names, objects):
    hits = []
    for m in _members(node):
        if isinstance(m, ast.Constant) and isinstance(m.value, str) and m.value in names:
            hits.append(m.value)
        elif isinstance(m, ast.Attribute):
            obj = _resolve(m)
            if obj is not None and id(obj) in objects:
                hits.append(ast.unparse(m))
    return hits


def op_tables(path: Path, names, objects):
    """(line, name, members) of every op-name table in the module at ``path``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            label = ", ".join(ast.unparse(t) for t in targets)
            value = node.value
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
            label, value = "in", node.comparators[-1]
        else:
            continue
        hits = _op_members(value, names, objects)
        if len(hits) >= 2:
            found.append((node.lineno, f"in {', '.join(hits)}" if label == "in" else label, hits))
    return found


def test_no_op_name_table_outside_dal_ops():
    names, objects = _registered()
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in EXEMPT_PACKAGES:
            continue
        for line, label, hits in op_tables(path, names, objects):
            if f"{rel}:{label}" in ALLOWED:
                continue
            offenders.append(f"dal/{rel}:{line}: {label} lists {', '.join(hits[:6])}")
    assert not offenders, ("op-name tables outside dal/ops (declare the op in dal/ops and derive the table from "
                           "the registry):\n" + "\n".join(offenders))


def test_the_check_finds_a_table():
    names, objects = _registered()
    probe = ROOT.parent / "tests" / "ops" / "_op_table_probe.txt"
    try:
        probe.write_text('KINDS = {"add": 1, "mul": 2}\nTARGETS = (torch.add, operator.mul)\nROLES = ("weight", "input")\n'
                         'NODES = ("Conv", "Add")\nok = kind in ("__radd__", "mul_")\n')
        found = op_tables(probe, names, objects)
    finally:
        probe.unlink()
    assert [(line, label) for line, label, _ in found] == [(1, "KINDS"), (2, "TARGETS"), (5, "in __radd__, mul_")]


def test_every_allowed_table_still_exists():
    """An entry of ALLOWED whose table is gone (derived since, or renamed) is removed from the list."""
    names, objects = _registered()
    present = {f"{path.relative_to(ROOT)}:{label}" for path in ROOT.rglob("*.py")
               for _, label, _ in op_tables(path, names, objects)}
    assert not set(ALLOWED) - present, f"ALLOWED lists tables that are gone: {sorted(set(ALLOWED) - present)}"
