"""What every benchmark prints first: the CPU model and the SIMD flags that decide its kernels
(the CPU differs between machines of the same kind, see ../shared/FACTS.md).

Benchmarks run as ``python bench/<name>.py``, so this file is importable as ``cpu``."""
from __future__ import annotations

import platform

#: the flags that change which kernels dal, torch and onnxruntime run
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def cpu_flags() -> str:
    """``"<model name>; flags: avx2 fma ..."`` from /proc/cpuinfo (the processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "unknown CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    kept = [f for f in SIMD_FLAGS if f in flags]
    return f"{model}; flags: {' '.join(kept) or 'none of ' + ', '.join(SIMD_FLAGS)}"
