"""House rules, read from the AST of every file in dal/ (each failure lists file:line and what).

- only dal/quantizer.py assigns or mutates a quantizer's ``state_code``;
- no private name (``_x``, not a dunder) is imported from another module of dal;
- no file is over MAX_FILE_LINES lines unless LONG_FILES lists it, with its reason, and it holds at
  most one class: the cap is a signal to look for a second concept, not a reason to split one class
  (or one concept) across "satellite" files that hold another module's methods;
- no function (methods included) over MAX_FUNCTION_LINES.

Every .py file under dal/ is read (dal/__init__.py, nested packages, dal/npu and dal/ops included).
"""
import ast
from pathlib import Path

import dal

ROOT = Path(dal.__file__).parent
STATE_OWNER = ROOT / "quantizer.py"
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
#: file relative to dal/ -> why it is one concept over MAX_FILE_LINES lines (it holds at most one class)
LONG_FILES: dict[str, str] = {}


def _sources():
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        yield path, text, ast.parse(text, filename=str(path))


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT.parent)}:{line}"


def _module_of(path: Path, node: ast.ImportFrom) -> str:
    """The absolute dotted module an ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    pkg = path.relative_to(ROOT.parent).with_suffix("").parts  # dal/a/__init__.py -> (dal, a, __init__)
    base = pkg[:len(pkg) - node.level]
    return ".".join(base + tuple(filter(None, (node.module or "").split("."))))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_state_code(node: ast.AST) -> bool:
    """``x.state_code``, or an element / slice of it (``x.state_code[...]``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "state_code"


def _is_in_place(method: str) -> bool:
    """torch's in-place convention: ``fill_``, ``copy_``, ``zero_``, ``add_``, ..."""
    return method.endswith("_") and not method.startswith("_")


def _state_code_writes(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            targets = []
        for target in targets:
            for sub in ast.walk(target):
                if _is_state_code(sub) and isinstance(getattr(sub, "ctx", None), (ast.Store, ast.Del)):
                    yield node.lineno, "assigns state_code"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if _is_in_place(func.attr) and _is_state_code(func.value):
                yield node.lineno, f"mutates state_code with .{func.attr}()"
            if (isinstance(func.value, ast.Name) and func.value.id == "torch" and func.attr.endswith("_")
                    and node.args and _is_state_code(node.args[0])):
                yield node.lineno, f"mutates state_code with torch.{func.attr}()"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "state_code"):
            yield node.lineno, "assigns state_code with setattr()"


def test_only_the_quantizer_writes_state_code():
    offenders = [f"{_where(path, line)}: {what} (only dal/quantizer.py may)"
                 for path, _, tree in _sources() if path != STATE_OWNER
                 for line, what in _state_code_writes(tree)]
    assert not offenders, "state_code written outside dal/quantizer.py:\n" + "\n".join(offenders)


def test_no_private_names_imported_across_modules():
    offenders = []
    for path, _, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _module_of(path, node)
            if module != "dal" and not module.startswith("dal."):
                continue
            private = [a.name for a in node.names if _is_private(a.name)]
            if private:
                offenders.append(f"{_where(path, node.lineno)}: imports private {', '.join(private)} from {module}")
    assert not offenders, "private names imported from another module of dal:\n" + "\n".join(offenders)


def test_files_are_short():
    """Over MAX_FILE_LINES only as one listed concept: a LONG_FILES entry with its reason, holding at
    most one class (top-level ``class`` statements); an entry for a file within the cap is stale."""
    offenders, long = [], set()
    for path, text, tree in _sources():
        n, rel = len(text.splitlines()), path.relative_to(ROOT).as_posix()
        if n <= MAX_FILE_LINES:
            continue
        long.add(rel)
        classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
        if not LONG_FILES.get(rel, "").strip():
            offenders.append(f"{_where(path, 1)}: {n} lines (at most {MAX_FILE_LINES}, or one concept listed in "
                             "LONG_FILES with its reason)")
        elif len(classes) > 1:
            offenders.append(f"{_where(path, 1)}: {n} lines holding {len(classes)} classes ({', '.join(classes)}): "
                             "only a file of one class may pass the cap")
    assert not offenders, "files too long:\n" + "\n".join(offenders)
    stale = sorted(set(LONG_FILES) - long)
    assert not stale, f"LONG_FILES lists files within {MAX_FILE_LINES} lines or gone (remove them): {stale}"


def test_sources_are_every_file_of_dal():
    """The rules above read every .py file of dal/, at any depth (os.walk, hidden folders included)."""
    import os
    walked = {Path(d, f) for d, _, files in os.walk(ROOT) for f in files if f.endswith(".py")}
    read = {path for path, _, _ in _sources()}
    assert read == walked and ROOT / "__init__.py" in read and ROOT / "npu" / "__init__.py" in read


def test_functions_are_short():
    offenders = []
    for path, _, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    offenders.append(f"{_where(path, node.lineno)}: def {node.name} is {n} lines "
                                     f"(at most {MAX_FUNCTION_LINES})")
    assert not offenders, "functions too long:\n" + "\n".join(offenders)
