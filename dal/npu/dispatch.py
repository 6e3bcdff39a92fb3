"""Which kernel variant runs: chosen at run time from this CPU's cpuid (csrc/isa.h).

One library holds every variant (portable C++, AVX2, AVX-VNNI, AVX-512 VNNI, AMX-INT8), each compiled
with its own target attribute; the library's flags stay at the x86-64 baseline, so a build
made on one machine runs on any other and picks that machine's best variant. The C++ entry
points refuse a variant the CPU lacks, so no illegal instruction can execute. AMX-INT8 needs
more than cpuid: the OS must save the tile state (XCR0) and, on Linux, grant this process the
tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM, requested by the library on first use);
``info()["status"]`` says which check failed where one did (``DAL_NPU_DISABLE_AMX=1`` turns it
off, e.g. to time avx512_vnni on the same CPU).

    dal.npu.info()                                   # what was chosen and why
    dal.npu.load("m.onnx", kernel="avx2")           # force a variant (tests, comparisons)

All variants compute identical exact int32 sums (tests/npu/test_dispatch.py pins each one the
machine supports to the portable one).
"""
from __future__ import annotations

from .errors import NPUError

NAMES = ("portable", "avx2", "avx_vnni", "avx512_vnni", "amx_int8")
WHAT = {"portable": "plain C++ loops (any CPU)",
        "avx2": "vpmaddwd on int16 pairs, ymm (needs avx2 + fma)",
        "avx_vnni": "vpdpbusd u8 x s8 quads, ymm, VEX encoded (needs avx_vnni)",
        "avx512_vnni": "vpdpbusd u8 x s8 quads, zmm, up to four 16-channel panels per tile "
                       "(needs avx512f/bw/vl + avx512_vnni)",
        "amx_int8": "tdpbusd u8 x s8 on AMX tiles, 32 pixels x 32 channels per tile step; int8 "
                    "activations offset to u8 as for vpdpbusd (needs amx_tile + amx_int8, the OS's "
                    "tile state and permission, and avx512_vnni for the remainders)"}


def _lib():
    from .build import kernels
    return kernels()


def supported() -> list[str]:
    """The variants this CPU can run (cpuid, via the library), best last."""
    lib = _lib()
    return [n for i, n in enumerate(NAMES) if lib.cpu_supports_isa(i)]


def resolve(kernel: str | None) -> int:
    """The variant index for ``kernel`` (None: the best this CPU runs). NPUError for an unknown
    name or one this CPU lacks, listing what it can run."""
    lib = _lib()
    if kernel is None:
        return int(lib.best_isa())
    if kernel not in NAMES:
        raise NPUError(f"kernel must be one of {list(NAMES)} or None, got {kernel!r}")
    isa = NAMES.index(kernel)
    if not lib.cpu_supports_isa(isa):
        raise NPUError(f"this CPU cannot run the {kernel!r} kernels ({WHAT[kernel]}); it runs {supported()}")
    return isa


def has_vnni(isa: int) -> bool:
    """True when variant ``isa`` packs 8-bit weights for vpdpbusd / tdpbusd (avx_vnni,
    avx512_vnni, amx_int8: all read the same [K/4][16][4] int8 panels)."""
    return isa >= NAMES.index("avx_vnni")


def info() -> dict:
    """What dal.npu runs on this machine: ``kernel`` (the variant chosen by default), ``why``,
    ``supported`` (every variant this CPU runs), ``status`` (per variant: why it can or cannot
    run here, e.g. the failing AMX check), ``cpu_flags`` (the SIMD flags /proc/cpuinfo lists),
    ``library`` (the compiled module's path). Builds the library on first use.

    >>> dal.npu.info()["kernel"]            # doctest: +SKIP
    'amx_int8'
    """
    from .build import cpu_flags
    lib = _lib()
    best = NAMES[int(lib.best_isa())]
    sup = supported()
    simd = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "amx", "sse4")))
    status = {n: str(lib.isa_status(i)) for i, n in enumerate(NAMES)}
    why = (f"{best}: {WHAT[best]}; the best of the variants this CPU's cpuid supports {sup} "
           f"(chosen at run time, not at build time; every variant is exact)")
    if "amx_int8" not in sup:
        why += f"; amx_int8 unavailable: {status['amx_int8']}"
    return {"kernel": best, "why": why, "supported": sup, "status": status, "cpu_flags": simd,
            "library": getattr(lib, "__file__", None)}
