"""Lazy build and load of the fused fake-quant kernel (``csrc/fake_quant.cpp``) through ctypes.

Nothing happens at import. :func:`library` compiles the kernel on first call
(:func:`compile_library`) and caches the shared object under ``$XDG_CACHE_HOME/dal/kernels``
(default ``~/.cache/dal/kernels``) with a name carrying :func:`cache_key`, a hash of the source,
flags, compiler (path and ``--version``) and platform, so an unchanged kernel is never built
twice and a changed one (or another compiler, or a CPU without AVX2) never loads a stale build.
Concurrent builders (pytest-xdist workers, DDP ranks, other checkouts and venvs) each compile to
a private temporary file and ``os.replace`` it into place: the rename is atomic, so a reader
sees either no file or a complete one, and the leftovers of a build killed midway are removed
by the next one. The compile takes about a second, so it is silent and takes no lock.

Why ctypes and not ``torch.utils.cpp_extension``: the kernel has a plain C ABI over raw float
pointers and includes no torch header, so it compiles in about a second instead of a minute,
needs no ninja, and does not depend on torch's C++ ABI. A missing compiler or a failed build
is not an error: :func:`library` returns None, :func:`status` says why, and the callers use the
eager path (which computes the same bits).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Optional

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "fake_quant.cpp")
_ABI_VERSION = 9
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
    if "f16c" in cpu:  # vcvtps2ph / vcvtph2ps: the float16 round trip (dal.formats.fp_cast)
        flags.append("-mf16c")
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


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    r = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{cxx} --version` exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


def cache_key(source: bytes, cxx: str, flags: list[str]) -> str:
    """16 hex digits naming the shared object: a hash of everything that changes it.

    That is the source text, the flags (CPU-dependent ones included), the compiler (resolved
    path and ``--version``), the platform and the C ABI version this module expects. Python and
    torch are not in it: the library includes neither.
    """
    cxx = shutil.which(cxx) or cxx
    parts = [source.hex(), *flags, os.path.realpath(cxx), _compiler_version(cxx), sys.platform,
             platform.machine(), str(_ABI_VERSION)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _host() -> str:
    return "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname()) or "host"


def _remove_abandoned(cache: str) -> None:
    """Delete temporary files of builds on this host whose process is gone (killed midway)."""
    for entry in os.listdir(cache):
        if not entry.startswith(".tmp-"):
            continue
        pid_s, _, rest = entry[len(".tmp-"):].partition("-")
        if not pid_s.isdigit() or rest.rpartition("-")[0] != _host() or int(pid_s) == os.getpid():
            continue
        try:
            os.kill(int(pid_s), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(cache, entry))
        except PermissionError:  # alive, another user's
            pass


def compile_library(source: str, cache_dir: str | None = None, cxx: str | None = None,
                    flags: list[str] | None = None) -> str:
    """Path of the shared object built from the C++ file ``source``, compiling only when missing.

    It is ``<cache_dir>/dal_<stem>_<cache_key>.so``, the key covering ``source`` and the headers of
    its directory (:func:`_source_text`) (default cache ``$XDG_CACHE_HOME/dal/kernels``,
    i.e. ``~/.cache/dal/kernels``). ``cxx`` defaults to ``$CXX``, else c++, else g++; ``flags``
    to this module's (-O3, AVX2/FMA and F16C when the CPU has them, OpenMP when the compiler links it).
    Each build compiles to a private ``.tmp-<pid>-<host>-*`` file and ``os.replace`` s it into
    place, so concurrent builders never see a partial file (the last rename wins; all are
    equivalent), and the files of a build killed midway are removed by the next build.
    Raises RuntimeError with the compiler's output when the compile fails.
    """
    cxx = cxx or _find_compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (looked for $CXX, c++, g++)")
    flags = _compile_flags(cxx) if flags is None else list(flags)
    text = _source_text(source)
    cache = os.path.abspath(cache_dir or _cache_dir())
    stem = os.path.splitext(os.path.basename(source))[0]
    target = os.path.join(cache, f"dal_{stem}_{cache_key(text, cxx, flags)}.so")
    if os.path.exists(target):
        return target
    os.makedirs(cache, exist_ok=True)
    _remove_abandoned(cache)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-{_host()}-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *flags, source, "-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _source_text(source: str) -> bytes:
    """The bytes a build of ``source`` depends on: the file, then every header (``*.h``) of its
    directory in name order (what ``#include "..."`` can reach), so a header change rebuilds."""
    with open(source, "rb") as f:
        text = f.read()
    folder = os.path.dirname(os.path.abspath(source))
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".h")):
        with open(os.path.join(folder, name), "rb") as f:
            text += b"\0" + name.encode() + b"\0" + f.read()
    return text


def _find_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@functools.lru_cache(maxsize=1)
def library():
    """The loaded kernel (a ``ctypes.CDLL``) or None when it cannot be built; see :func:`status`."""
    global _status
    lib, _status = load_library(_SOURCE)
    return lib


def load_library(source: str) -> tuple[Optional[ctypes.CDLL], str]:
    """``(library, status)``: the fake-quant kernel built from the C++ file ``source`` (cached by
    :func:`compile_library`) with its argument types set, or ``(None, why not)``. Uncached and
    without effect on :func:`library` / :func:`status`: bench/kernel_ab.py loads another
    checkout's source with it to compare two builds in one process."""
    if not os.path.exists(source):
        return None, f"kernel source {source} is missing from this installation"
    cxx = _find_compiler()
    if cxx is None:
        return None, "no C++ compiler found (looked for $CXX, c++, g++): install one, e.g. apt-get install g++"
    try:
        lib = ctypes.CDLL(compile_library(source, cxx=cxx))
    except Exception as e:  # compile error, unwritable cache, bad .so: the eager path still works
        return None, f"building the fused fake-quant kernel from {source} failed: {e}"
    if lib.dal_fq_abi_version() != _ABI_VERSION:
        return None, f"the kernel built from {source} has ABI version {lib.dal_fq_abi_version()}, not {_ABI_VERSION}"
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.dal_fq_forward.argtypes = [p, p, p, i64, i64, i64, i64, p, p, p, i32, i32]
    lib.dal_fq_forward.restype = None
    lib.dal_fq_backward.argtypes = [p, p, p, i64, i64, i32]
    lib.dal_fq_backward.restype = None
    lib.dal_row_minmax.argtypes = [p, i64, i64, p, p, p, i32]
    lib.dal_row_minmax.restype = i32
    lib.dal_fold_forward.argtypes = [p, p, p, i64, i64, i64, i64, p, p, p, p, i32, i32, i32]
    lib.dal_fold_forward.restype = None
    lib.dal_fold_backward.argtypes = [p, p, p, p, p, p, i64, i64, p, i32, i32]
    lib.dal_fold_backward.restype = None
    f32, f64 = ctypes.c_float, ctypes.c_double
    lib.dal_track_qparams.argtypes = [p, p, i64, p, p, p, i32, f32, i32, f64, f64, f64, f64, i32, p, p, p, p, p]
    lib.dal_track_qparams.restype = i32
    lib.dal_fold_track_forward.argtypes = [p, p, p, i64, i64, p, p, p, p, i32, f32, i32, f64, f64, f64, f64, i32,
                                           p, p, p, p, p, i32, i32, i32]
    lib.dal_fold_track_forward.restype = i32
    lib.dal_kernel_params.argtypes = [p, p, i64, f64, f64, f64, p, p, p]
    lib.dal_kernel_params.restype = None
    lib.dal_fq_forward_fixed.argtypes = [p, p, p, i64, i64, i64, i64, p, p, f64, f64, f64, i32, i32]
    lib.dal_fq_forward_fixed.restype = None
    lib.dal_track_fq_forward.argtypes = [p, p, p, i64, p, p, p, i32, f32, i32, f64, f64, f64, f64, i32, p, p, i32,
                                         i32]
    lib.dal_track_fq_forward.restype = i32
    lib.dal_channel_divide_backward.argtypes = [p, p, p, p, p, i64, i64, i64, i32]
    lib.dal_channel_divide_backward.restype = None
    lib.dal_bias_fq_forward.argtypes = [p, p, p, i64, p, p, i64, f64, f64]
    lib.dal_bias_fq_forward.restype = None
    lib.dal_mask_all_set.argtypes = [p, i64, i64]
    lib.dal_mask_all_set.restype = i32
    lib.dal_fp_cast_round_trip.argtypes = [p, p, i64, i32, i32]
    lib.dal_fp_cast_round_trip.restype = None
    lib.dal_fold_factor.argtypes = [p, p, f32, i64, i32, p, p, p]
    lib.dal_fold_factor.restype = None
    lib.dal_fold_factor_backward.argtypes = [p, p, p, i64, p]
    lib.dal_fold_factor_backward.restype = None
    return lib, "built and loaded"


def status() -> str:
    """Why the fused kernel is or is not in use (for error reports and the benchmark)."""
    return _status
