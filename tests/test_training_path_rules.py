"""DESIGN's rule for the training path, read from the source: no thread-local, no process-wide
switch, no environment flag, no reference count, no raw write into a tensor's memory, no private
torch or CPython function.

The training path is the code a QAT step runs or that ``prepare_qat`` installs: ``dal/quantizer*.py``
and the packages below. Each file is parsed (``ast``: docstrings and comments may name anything);
every dotted name it uses is resolved through its imports (``import ctypes as c`` then
``c.memmove`` is ``ctypes.memmove``) and checked against the patterns. A hit fails the test
naming ``file:line`` and the rule. The exceptions are listed below, each with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import dal

ROOT = Path(dal.__file__).parent
PACKAGES = ("formats", "observers", "nn", "prepare", "calibration", "sparsity", "kernels")

#: (dotted-name prefix, why it is refused). A name matches when it equals the prefix or starts
#: with it followed by a dot; a prefix ending in "." or "_" matches any name that starts with it.
RULES = (
    ("threading.local", "a thread-local"),
    ("_thread._local", "a thread-local"),
    ("threading.settrace", "a process-wide switch"),
    ("os.environ", "an environment flag"),
    ("os.getenv", "an environment flag"),
    ("os.putenv", "an environment flag"),
    ("os.unsetenv", "an environment flag"),
    ("sys.getrefcount", "a reference count (CPython internal)"),
    ("sys._", "a private CPython function"),
    ("sys.setswitchinterval", "a process-wide switch"),
    ("sys.setrecursionlimit", "a process-wide switch"),
    ("gc.disable", "a process-wide switch"),
    ("gc.freeze", "a process-wide switch"),
    ("gc.set_threshold", "a process-wide switch"),
    ("ctypes.memmove", "a raw write into memory (a tensor's)"),
    ("ctypes.memset", "a raw write into memory (a tensor's)"),
    ("ctypes.string_at", "a raw read of memory"),
    ("ctypes.util", "a system library lookup (mallopt's libc)"),
    ("ctypes.CDLL", "a library loaded outside the kernel loaders"),
    ("ctypes.cdll", "a library loaded outside the kernel loaders"),
    ("torch._", "a private torch function"),
    ("torch.set_flush_denormal", "a process-wide switch"),
    ("torch.set_num_threads", "a process-wide switch"),
    ("torch.set_num_interop_threads", "a process-wide switch"),
    ("torch.set_default_dtype", "a process-wide switch"),
    ("torch.set_default_device", "a process-wide switch"),
    ("torch.set_default_tensor_type", "a process-wide switch"),
    ("torch.set_float32_matmul_precision", "a process-wide switch"),
    ("torch.use_deterministic_algorithms", "a process-wide switch"),
    ("torch.manual_seed", "a process-wide switch (the global generator)"),
    ("torch.backends.cudnn.benchmark", "a process-wide switch"),
    ("torch.backends.cudnn.deterministic", "a process-wide switch"),
    ("torch.backends.cuda.matmul", "a process-wide switch"),
    ("torch.autograd.set_detect_anomaly", "a process-wide switch"),
    ("torch.untyped_storage._use_count", "a storage reference count (private)"),
)
#: attribute names refused on any object (their owner cannot be resolved statically)
ATTRIBUTES = {
    "mallopt": "a process-wide switch (glibc's heap)",
    "from_address": "a raw write into memory (a tensor's)",
    "from_buffer": "a raw view of memory",
    "_use_count": "a storage reference count (private)",
    "getrefcount": "a reference count (CPython internal)",
}
#: (file relative to dal/, rule prefix) -> why it is allowed there
EXCEPTIONS = {
    ("formats/native.py", "ctypes.CDLL"): "the kernel loader: loads the library it built (build time, not a flag)",
    ("formats/island.py", "ctypes.CDLL"): "the FP16 island kernel's loader, as native.py's",
    ("kernels/lsq_kernel.py", "ctypes.CDLL"): "the LSQ backward kernel's loader, as native.py's",
    ("kernels/blocked_sums.py", "ctypes.CDLL"): "the integer model's blocked-linear kernel's loader (dal.convert, not a QAT step), as native.py's",
    ("formats/native.py", "os.environ"): "XDG_CACHE_HOME (where the build is cached) and CXX (which compiler "
                                         "builds it): where and how to build, read when building, not a switch",
}


def _files() -> list[Path]:
    files = sorted(ROOT.glob("quantizer*.py"))
    for pkg in PACKAGES:
        if (ROOT / pkg).is_dir():
            files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in the file."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _matches(name: str, prefix: str) -> bool:
    if prefix.endswith((".", "_")):  # a dunder (torch.__file__, torch.__version__) is public
        return name.startswith(prefix) and not name[len(prefix) - 1:].startswith("__")
    return name == prefix or name.startswith(prefix + ".")


def uses(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every name, attribute chain and import in ``path``, resolved
    through the file's imports."""
    tree = ast.parse(path.read_text(), str(path))
    alias = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, (ast.Attribute, ast.Name)):
            parts = _dotted(node)
            if parts is None:  # an attribute of a call result or a subscript: its name alone
                found.append((node.lineno, f"?.{node.attr}"))
                continue
            head = alias.get(parts[0], parts[0])
            found.append((node.lineno, ".".join([head] + parts[1:])))
    return found


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: name: rule`` for every use in ``files`` (under ``root``) that a rule refuses."""
    out = set()
    for path in files:
        rel = path.relative_to(root).as_posix()
        for line, name in uses(path):
            for prefix, why in RULES:
                if _matches(name, prefix) and (rel, prefix) not in EXCEPTIONS:
                    out.add(f"{root.name}/{rel}:{line}: {name}: {why}")
            attr = name.rsplit(".", 1)[-1]
            if attr in ATTRIBUTES:
                out.add(f"{root.name}/{rel}:{line}: {name}: {ATTRIBUTES[attr]}")
    return sorted(out)


def test_the_training_path_keeps_designs_rules():
    files = _files()
    assert len(files) > 50, "the training path's files were not found"
    bad = violations(files)
    assert not bad, "DESIGN.md: no thread-locals, switches, flags or internals in the training path:\n" + \
        "\n".join(bad)


def test_every_exception_is_still_needed():
    """An exception whose use has gone is removed from the list (it would hide a new one)."""
    files = {p.relative_to(ROOT).as_posix(): p for p in _files()}
    for (rel, prefix), why in EXCEPTIONS.items():
        assert rel in files, f"{rel} ({why}) is gone: remove its exception"
        assert any(_matches(name, prefix) for _, name in uses(files[rel])), \
            f"dal/{rel} no longer uses {prefix}: remove its exception ({why})"


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    """The checker itself, on a file that breaks every rule once (each spelled another way)."""
    src = tmp_path / "bad.py"
    src.write_text(
        "import threading\nimport ctypes as c\nimport os, sys\nimport torch\n"
        "from torch._C import _functorch\nfrom threading import local\n"
        "_L = threading.local()\n"
        "def f(t, lib):\n"
        "    c.memmove(t.data_ptr(), b'', 0)\n"
        "    c.c_int64.from_address(t.data_ptr()).value += 1\n"
        "    n = sys.getrefcount(t) + t.untyped_storage()._use_count()\n"
        "    flag = os.environ.get('DAL_X', '1')\n"
        "    torch.set_flush_denormal(True)\n"
        "    lib.mallopt(-1, 0)\n"
        "    return torch._C._len_torch_function_stack(), sys._getframe(0)\n"
    )
    bad = violations([src], tmp_path)
    for line, what in ((5, "torch._C"), (6, "threading.local"), (7, "threading.local"), (9, "ctypes.memmove"),
                       (10, "from_address"), (11, "sys.getrefcount"), (11, "_use_count"), (12, "os.environ"),
                       (13, "torch.set_flush_denormal"), (14, "mallopt"), (15, "torch._C"), (15, "sys._getframe")):
        assert any(f"bad.py:{line}: " in row and what in row for row in bad), (line, what, bad)
    assert violations([tmp_path / "good.py"], tmp_path) == [] if _write_good(tmp_path) else False


def _write_good(folder: Path) -> bool:
    """A file that names the same things only in strings and comments, or as its own names."""
    (folder / "good.py").write_text(
        '"""threading.local, os.environ, torch._C and ctypes.memmove are named here only."""\n'
        "import torch  # torch.set_flush_denormal(True) in a comment\n"
        "def f(environ, local):\n"
        "    return torch.empty(environ, local)\n"
    )
    return True
