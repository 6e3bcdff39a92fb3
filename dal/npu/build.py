"""Lazy, cached, process-safe build of the NPU reference C++ kernels (``dal/npu/csrc``).

Nothing happens at import. :func:`kernels` returns the compiled module, building it with
``torch.utils.cpp_extension`` on first use (a C++ compiler and ninja are needed then, and only
then). :func:`build_extension` is the same machinery for any extension; the tests drive it with
a tiny source.

**Cache key.** A build is named ``<prefix>_<hash>``, the hash covering everything that changes
the binary (:func:`cache_key`): the content of the sources and of the headers beside them, the
compile and link flags (none depends on the CPU: see Flags), the compiler (resolved path and ``--version``), torch (version, git revision,
``_GLIBCXX_USE_CXX11_ABI``, include and library paths) and Python (version, extension suffix,
include path). Two checkouts with the same sources and venv share one build; two venvs never
collide. Builds live in ``cache_dir`` if given, else ``$XDG_CACHE_HOME/dal/npu`` (default
``~/.cache/dal/npu``); build_cache.py says how concurrent and killed builds are handled (private
build folders, an atomic rename, a flock the kernel releases when its holder dies).

**Flags.** ``-O3 -fopenmp -ffp-contract=off`` (the float requantizer must round exactly where
the formula says: no fused multiply-add), and no ``-m`` flag: the library is built for the
x86-64 baseline whatever the build machine, and every faster kernel variant (AVX2, AVX-VNNI,
AVX-512 VNNI) is compiled in with a per-function target attribute and chosen at run time from
the CPU's cpuid (csrc/isa.h, :func:`dal.npu.info`). One build serves every x86-64 CPU.
``sanitize=True`` builds a separate AddressSanitizer variant (used by ``mk/asan.mk``).

**Build time.** Parsing torch's headers was most of a first build: per translation unit
``<torch/extension.h>`` (all of libtorch's C++ API and pybind11) costs about 25 s of CPU,
``<torch/python.h>`` (pybind11 and its Tensor casters) 13 s, ``<torch/types.h>`` (ATen and the
``torch::`` names) 7 s. So the build has two units, one per core of a small machine: ``module.cpp``
(the bindings: torch/python.h) and ``kernels.cpp``, which includes the seven kernel sources
(torch/types.h, parsed once). Measured (fresh cache, compiler CPU of the whole build, a 2-core
machine under load): eight units with torch/extension.h 224 s; eight with torch/types.h 101 s;
these two 32 s (54 s wall at load 6-9).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from contextlib import contextmanager

from . import build_cache

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# Two translation units (Build time, above): kernels.cpp #includes isa, gemm_s16, conv_s16, requant,
# qconv, pool_codes, quantize, blocked_gemm and lut16.cpp; every .cpp and .h of csrc/ is in the cache key (kernels()).
_SOURCES = ("kernels.cpp", "module.cpp")
_HEADER_EXTS = (".h", ".hpp", ".hh", ".inc")
_LIB_EXT = ".pyd" if os.name == "nt" else ".so"
_PROTOCOL = "1"  # bump when the way a build is made changes (it is part of every key)
_LOADED: dict = {}  # module name (= key) -> module, so each build is imported once per process
_NPU_MESSAGE = ("dal.npu: compiling the C++ kernels into {dir} (under a minute, once per change of "
                "source, flags, compiler, torch or Python)")


class BuildError(RuntimeError):
    """The C++ kernels could not be built: what is missing (compiler, ninja) or the compile error."""



def import_cpp_extension():
    """``torch.utils.cpp_extension``, imported without its CUDA notice: on a CPU-only machine its
    import logs "No CUDA runtime is found" at WARNING on every process that uses dal.npu, about
    a CUDA build dal.npu never does. The logger's level is restored right after the import."""
    import logging

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension

def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_avx2() -> bool:
    """True when /proc/cpuinfo lists both avx2 and fma (Linux); False where unknown."""
    flags = _cpu_flags()
    return "avx2" in flags and "fma" in flags


def cpu_has_avx_vnni() -> bool:
    """True when /proc/cpuinfo lists avx_vnni (VEX vpdpbusd: u8 x s8 summed in exact int32)."""
    return cpu_has_avx2() and "avx_vnni" in _cpu_flags()


def cpu_flags() -> set:
    """The flags /proc/cpuinfo lists (Linux; empty elsewhere): what :func:`dal.npu.info` reports
    next to the kernel chosen from cpuid."""
    return set(_cpu_flags())


def _flags(sanitize: bool) -> list[str]:
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if sanitize:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
    return flags


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/dal/npu``, default ``~/.cache/dal/npu`` (the standard per-user cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dal", "npu")


def find_compiler() -> str:
    """Absolute path of the C++ compiler cpp_extension will use: ``$CXX``, else ``c++``.

    Raises BuildError, saying what to install or set, when it is not found.
    """
    name = os.environ.get("CXX") or "c++"
    path = shutil.which(name)
    if path is None:
        hint = " (g++ is installed: set CXX=g++)" if shutil.which("g++") else ""
        raise BuildError(f"dal.npu needs a C++ compiler to build its kernels: {name!r} "
                         f"{'($CXX) ' if os.environ.get('CXX') else ''}was not found on PATH{hint}. "
                         "Install one, e.g. `apt-get install g++`, and retry.")
    return path


@functools.lru_cache(maxsize=None)
def _compiler_version(path: str) -> str:
    r = subprocess.run([path, "--version"], capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"the C++ compiler {path} does not run (`{path} --version` exited "
                         f"{r.returncode}): {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _headers_beside(sources) -> list[str]:
    dirs = sorted({os.path.dirname(os.path.abspath(s)) for s in sources})
    return [os.path.join(d, n) for d in dirs for n in sorted(os.listdir(d)) if n.endswith(_HEADER_EXTS)]


def cache_key(sources, cflags=(), ldflags=(), cxx: str | None = None, depends=None) -> dict:
    """Everything that decides the binary, as a JSON-able dict; equal dicts = same binary.

    ``sources`` and ``depends`` (default: the headers in the sources' folders) count by
    file name and content, not path. ``cxx`` defaults to :func:`find_compiler`. Imports torch.

    >>> cache_key(["a.cpp"], ["-O3"])["cflags"]      # doctest: +SKIP
    ['-O3']
    """
    cxx = cxx or find_compiler()  # first: a missing compiler fails fast
    found = shutil.which(cxx)
    if found is None:
        raise BuildError(f"C++ compiler {cxx!r} not found (on PATH or as a path): install g++ or set CXX")
    cxx = os.path.abspath(found)
    import torch
    cpp_extension = import_cpp_extension()
    depends = _headers_beside(sources) if depends is None else depends
    return {
        "protocol": _PROTOCOL,
        "sources": [[os.path.basename(s), _file_digest(s)] for s in sources],
        "depends": sorted([os.path.basename(d), _file_digest(d)] for d in depends),
        "cflags": list(cflags), "ldflags": list(ldflags),
        "compiler": [os.path.realpath(cxx), _compiler_version(cxx)],
        "torch": [torch.__version__, str(torch.version.git_version),
                  f"cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"],
        "torch_paths": cpp_extension.include_paths() + cpp_extension.library_paths(),
        "python": [sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "",
                   sysconfig.get_paths()["include"], sys.platform, platform.machine()],
    }


def key_digest(key: dict) -> str:
    """16 hex digits of the SHA-256 of ``key`` (the suffix of the build's name)."""
    return hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]


def _ninja_dirs() -> list[str]:
    dirs = [os.path.dirname(sys.executable)]  # a venv's bin/, on PATH only when activated
    try:
        import ninja  # the PyPI package ships the binary
        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    return dirs


def _ninja_dir() -> str | None:
    """None when ninja is on PATH, else the folder holding it; BuildError when there is none."""
    if shutil.which("ninja"):
        return None
    found = next((d for d in _ninja_dirs() if shutil.which("ninja", path=d)), None)
    if found is None:
        raise BuildError("dal.npu builds its C++ kernels with torch.utils.cpp_extension, which "
                         "needs the ninja build tool: not found on PATH nor next to "
                         f"{sys.executable}. Install it with `pip install ninja` (in this "
                         "environment) or `apt-get install ninja-build`, and retry.")
    return found


@contextmanager
def _on_path(folder: str | None):
    """Prepend ``folder`` to PATH for the ``with`` block (cpp_extension finds ninja only there)."""
    if folder is None:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = folder + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _import(name: str, path: str):
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:
        raise BuildError(f"the cached build {path} does not load ({e}); delete "
                         f"{os.path.dirname(path)} and retry, it will be rebuilt") from e
    return module


def build_extension(prefix: str, sources, cflags=(), ldflags=(), *, cache_dir: str | None = None,
                    depends=None, message: str | None = None):
    """Return the torch C++ extension built from ``sources``, compiling it only if no build
    with the same :func:`cache_key` exists in ``cache_dir`` (default :func:`default_cache_dir`).

    The module is named ``<prefix>_<key_digest>``, so its ``PYBIND11_MODULE`` must use
    ``TORCH_EXTENSION_NAME``. One line (``message``, ``{dir}`` replaced by the build's folder)
    goes to stderr when, and only when, it compiles. In one process each key is built or loaded
    once, whatever ``cache_dir``. Raises BuildError naming what is missing or the compile error.

    >>> m = build_extension("tiny", ["tiny.cpp"], ["-O2"])   # doctest: +SKIP
    """
    key = cache_key(sources, cflags, ldflags, depends=depends)
    name = f"{prefix}_{key_digest(key)}"
    if name in _LOADED:
        return _LOADED[name]
    cpp_extension = import_cpp_extension()  # heavy: only when building or loading
    root = os.path.abspath(cache_dir or default_cache_dir())
    finished = os.path.join(root, name, name + _LIB_EXT)
    ninja_dir = None if os.path.exists(finished) else _ninja_dir()  # fail before saying "compiling"

    def compile_into(build_dir: str):
        os.makedirs(build_dir)
        # the name already carries the hash: cpp_extension's own "_v1" renaming would break the
        # module name (its versioner keys on the build folder, which is new for every build)
        versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
        if versioner is not None:
            versioner.entries.pop(name, None)
        with _on_path(ninja_dir):
            module = cpp_extension.load(name=name, sources=[os.path.abspath(s) for s in sources],
                                        extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                                        build_directory=build_dir, verbose=False)
        if module.__name__ != name:
            raise BuildError(f"cpp_extension built {module.__name__!r}, expected {name!r}")
        return module.__file__, module

    text = (message or "dal.npu: compiling {name} into {dir}").format(name=name, dir=os.path.join(root, name))
    try:
        path, module = build_cache.get_or_build(root, name, os.path.basename(finished), compile_into, key, text)
    except BuildError:
        raise
    except Exception as e:  # compile errors, unwritable cache, ...
        raise BuildError(f"building the C++ extension {name} (cache {root}) failed: {e}") from e
    if module is None:
        module = _import(name, path)
    else:
        module.__file__ = path  # it was loaded from the private folder, then moved here
    _LOADED[name] = module
    return module


@functools.lru_cache(maxsize=None)
def kernels(sanitize: bool = False, cache_dir: str | None = None):
    """Return the compiled kernel module, building it on first use (under a minute, said on stderr).

    ``cache_dir`` relocates the cache (default :func:`default_cache_dir`); because a process
    keeps each build it loaded, calling ``kernels(cache_dir=d)`` once, before anything else
    uses dal.npu, makes every later ``kernels()`` of that process use the build from ``d``.
    """
    flags = _flags(sanitize)
    ldflags = ["-fopenmp"] + (["-fsanitize=address"] if sanitize else [])
    depends = [os.path.join(_CSRC, n) for n in sorted(os.listdir(_CSRC)) if n.endswith((".cpp", ".h"))]
    return build_extension(f"dal_npu{'_asan' if sanitize else ''}", [os.path.join(_CSRC, s) for s in _SOURCES],
                           flags, ldflags, cache_dir=cache_dir, depends=depends, message=_NPU_MESSAGE)
