"""dal.prepare.heap: after prepare_qat, glibc keeps freed heap blocks instead of trimming them.

Each case runs in a fresh interpreter (the thresholds are process-wide and set once): 96 MiB of
16 MiB tensors are allocated, touched and freed, then glibc's own ``mallinfo2`` says how much
freed memory the heap still holds (``fordblks``). With the thresholds set the blocks came
from the heap and stay; opted out, glibc's defaults mmap each block and unmap it on free.
"""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc thresholds")

_SCRIPT = r"""
import ctypes, torch, dal
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
dal.prepare_qat(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), recipe="int8_balanced")
blocks = [torch.ones(4 << 20) for _ in range(6)]  # 6 x 16 MiB, touched
del blocks
info = libc.mallinfo2()
print(info.fordblks >> 20)
"""


def _kept_mib(env_extra: dict) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_prepare_qat_keeps_freed_heap_memory():
    kept = _kept_mib({})
    assert kept >= 96, f"the heap kept {kept} MiB of the 96 MiB freed"


def test_opt_out_leaves_glibc_defaults():
    kept = _kept_mib({"DAL_RETAIN_FREED_MEMORY": "0"})
    assert kept < 64, f"opted out, yet the heap kept {kept} MiB (glibc trims above 64 MiB at most)"


def test_user_malloc_environment_wins():
    # The user's own threshold (1 MiB: every 16 MiB block is mmapped and unmapped) is left alone.
    kept = _kept_mib({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert kept < 64
