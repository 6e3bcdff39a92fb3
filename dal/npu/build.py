"""Lazy build of the NPU reference C++ kernels (``dal/npu/csrc``) with torch's cpp_extension.

Nothing happens at import: :func:`kernels` builds (or loads the cached build of) the extension
on first call. The extension name carries a hash of the sources and flags, so a changed source
builds a new extension and an unchanged one is loaded from torch's cache
(``~/.cache/torch_extensions``). Two processes building at once are serialised by
cpp_extension's own file lock in the build directory.

Flags: ``-O3 -mavx2 -mfma -fopenmp -DDAL_NPU_AVX2`` when the CPU reports AVX2 and FMA in
/proc/cpuinfo (plus ``-mavxvnni -DDAL_NPU_VNNI`` with avx_vnni), else portable ``-O3 -fopenmp``. ``-ffp-contract=off`` always: the float
requantizer must round exactly where the formula says (no fused multiply-add).
``sanitize=True`` builds a separate AddressSanitizer variant (used by ``mk/asan.mk``).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("gemm_s16.cpp", "conv_s16.cpp", "requant.cpp", "qconv.cpp", "pool_codes.cpp", "module.cpp")


class BuildError(RuntimeError):
    """The C++ kernels could not be built (no compiler, or a compile error)."""


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


def _flags(avx2: bool, sanitize: bool) -> list[str]:
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if avx2:
        flags += ["-mavx2", "-mfma", "-DDAL_NPU_AVX2"]
        if cpu_has_avx_vnni():
            flags += ["-mavxvnni", "-DDAL_NPU_VNNI"]
    if sanitize:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O1"]
    return flags


def _source_hash(flags: list[str]) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(_CSRC)):
        if name.endswith((".cpp", ".h")):
            h.update(name.encode())
            with open(os.path.join(_CSRC, name), "rb") as f:
                h.update(f.read())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:12]


@functools.lru_cache(maxsize=2)
def kernels(sanitize: bool = False):
    """Return the compiled kernel module, building it on first use (about a minute)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise BuildError(
            "dal.npu needs a C++ compiler to build its kernels: none found (looked for $CXX, "
            "c++, g++). Install one, e.g. `apt-get install g++`, and retry.")
    from torch.utils import cpp_extension  # heavy import: only here, never at import time

    avx2 = cpu_has_avx2()
    flags = _flags(avx2, sanitize)
    name = f"dal_npu_{'asan_' if sanitize else ''}{_source_hash(flags)}"
    ldflags = ["-fopenmp"] + (["-fsanitize=address"] if sanitize else [])
    try:
        return cpp_extension.load(
            name=name,
            sources=[os.path.join(_CSRC, s) for s in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=ldflags,
            verbose=False,
        )
    except Exception as e:  # compile errors, missing ninja, ...
        raise BuildError(f"building the dal.npu C++ kernels ({name}) failed: {e}") from e
