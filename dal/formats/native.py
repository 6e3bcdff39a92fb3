"""Lazy build and load of the fused fake-quant kernel (``csrc/fake_quant.cpp``) through ctypes.

Nothing happens at import. :func:`library` compiles the kernel on first call and caches the
shared object under ``$XDG_CACHE_HOME/dal`` (default ``~/.cache/dal``) with a name carrying a
hash of the source, flags and compiler, so an unchanged kernel is never built twice and a
changed one never loads a stale build. Concurrent builders (pytest-xdist workers, DDP ranks)
each compile to a private temporary file and ``os.replace`` it into place: the rename is atomic,
so a reader sees either no file or a complete one.

Why ctypes and not ``torch.utils.cpp_extension``: the kernel has a plain C ABI over raw float
pointers and includes no torch header, so it compiles in about a second instead of a minute,
needs no ninja, and does not depend on torch's C++ ABI. A missing compiler or a failed build
is not an error: :func:`library` returns None, :func:`status` says why, and the callers use the
eager path (which computes the same bits).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "fake_quant.cpp")
_ABI_VERSION = 1
_status = "not built yet (the fused kernel is built on the first eligible fake_quantize call)"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags(cxx: str) -> list[str]:
    # -ffp-contract=off: x / s and c * s must each round once, as in the eager path (no FMA).
    flags = ["-O3", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off", "-fno-math-errno"]
    cpu = _cpu_flags()
    if {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma"]
    if _accepts(cxx, "-fopenmp"):
        flags.append("-fopenmp")
    return flags


@functools.lru_cache(maxsize=None)
def _accepts(cxx: str, flag: str) -> bool:
    """Whether the compiler can build and link an OpenMP program (tiny test compile)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("int main(){return 0;}\n")
        r = subprocess.run([cxx, flag, src, "-o", os.path.join(d, "t")], capture_output=True)
        return r.returncode == 0


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dal", "kernels")


def _build(cxx: str) -> str:
    flags = _compile_flags(cxx)
    with open(_SOURCE, "rb") as f:
        source = f.read()
    h = hashlib.sha256(source + " ".join([cxx, *flags, sys.platform]).encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"dal_fake_quant_{h}.so")
    if os.path.exists(target):
        return target
    os.makedirs(_cache_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
    os.close(fd)
    try:
        r = subprocess.run([cxx, *flags, _SOURCE, "-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def library():
    """The loaded kernel (a ``ctypes.CDLL``) or None when it cannot be built; see :func:`status`."""
    global _status
    if not os.path.exists(_SOURCE):
        _status = f"kernel source {_SOURCE} is missing from this installation"
        return None
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        _status = "no C++ compiler found (looked for $CXX, c++, g++): install one, e.g. apt-get install g++"
        return None
    try:
        lib = ctypes.CDLL(_build(cxx))
    except Exception as e:  # compile error, unwritable cache, bad .so: the eager path still works
        _status = f"building the fused fake-quant kernel failed: {e}"
        return None
    if lib.dal_fq_abi_version() != _ABI_VERSION:
        _status = "the cached kernel has an unexpected ABI version"
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dal_fq_forward.argtypes = [p, p, p, i64, i64, i64, i64, p, p, p, i32, i32]
    lib.dal_fq_forward.restype = None
    lib.dal_fq_backward.argtypes = [p, p, p, i64, i64, i32]
    lib.dal_fq_backward.restype = None
    _status = "built and loaded"
    return lib


def status() -> str:
    """Why the fused kernel is or is not in use (for error reports and the benchmark)."""
    return _status
