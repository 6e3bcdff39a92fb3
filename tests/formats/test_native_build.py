"""The ctypes build of dal.formats.native: keyed cache, concurrent builders, killed builds.

Real compiles in real processes of a tiny C++ file through the same compile_library that
builds the fused fake-quant kernel.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dal.formats.native import cache_key, compile_library

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_CXX = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
pytestmark = pytest.mark.skipif(REAL_CXX is None, reason="no C++ compiler on this machine")
_LOAD = ("import ctypes, sys; from dal.formats.native import compile_library; "
         "p = compile_library(sys.argv[1], cache_dir=sys.argv[2]); print(ctypes.CDLL(p).answer(), p)")


def _tiny(folder: pathlib.Path, value: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "tiny.cpp"
    src.write_text(f'extern "C" int answer() {{ return {value}; }}\n')
    return str(src)


def _start(src: str, cache, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _LOAD, src, str(cache)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    out, err = p.communicate()
    assert p.returncode == 0, err
    answer, path = out.split()
    return int(answer), path


def _wrapper(tmp_path: pathlib.Path, version: str, gate: pathlib.Path | None = None) -> str:
    """A compiler that reports ``version`` and, while ``gate`` exists, writes its pid next to
    the gate and stops instead of building a shared object; otherwise it is the real one."""
    path = tmp_path / f"cxx-{len(list(tmp_path.glob('cxx-*')))}"
    block = (f'case " $* " in *" -shared "*) if [ -e "{gate}" ]; then echo $$ > "{gate}.pid.tmp"; '
             f'mv "{gate}.pid.tmp" "{gate}.pid"; exec sleep 1000000; fi;; esac\n') if gate else ""
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{version}"; exit 0; fi\n{block}'
                    f'exec "{os.path.realpath(shutil.which(REAL_CXX))}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_cache_key_covers_source_flags_and_compiler(tmp_path):
    src = b'extern "C" int answer() { return 1; }\n'
    k = cache_key(src, REAL_CXX, ["-O2"])
    assert cache_key(src, REAL_CXX, ["-O2"]) == k
    v1, v2 = _wrapper(tmp_path, "cc 1.0"), _wrapper(tmp_path, "cc 2.0")
    others = [cache_key(src.replace(b"1", b"2"), REAL_CXX, ["-O2"]), cache_key(src, REAL_CXX, ["-O2", "-mavx2"]),
              cache_key(src, v1, ["-O2"]), cache_key(src, v2, ["-O2"])]
    assert len({k, *others}) == 5
    # the same path answering another --version (an upgraded compiler) is another key
    upgraded = tmp_path / "c++"
    shutil.copy(v1, upgraded)
    before = _key_in_new_process(upgraded)
    shutil.copy(v2, upgraded)
    assert _key_in_new_process(upgraded) != before


def _key_in_new_process(cxx) -> str:
    code = "import sys; from dal.formats.native import cache_key; print(cache_key(b'x', sys.argv[1], []))"
    return subprocess.run([sys.executable, "-c", code, str(cxx)], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_two_sources_built_at_once_by_two_processes(tmp_path):
    cache = tmp_path / "cache"
    a, b = _tiny(tmp_path / "a", 1), _tiny(tmp_path / "b", 2)
    procs = [_start(a, cache), _start(b, cache), _start(a, cache)]  # the third races the first
    results = [_finish(p) for p in procs]
    assert [r[0] for r in results] == [1, 2, 1]
    assert results[0][1] == results[2][1] != results[1][1]
    stamps = {r[1]: os.stat(r[1]).st_mtime_ns for r in results}
    again = [_finish(_start(a, cache)), _finish(_start(b, cache))]
    assert {r[1]: os.stat(r[1]).st_mtime_ns for r in again} == stamps, "a cached build was compiled again"
    assert not [n for n in os.listdir(cache) if n.startswith(".tmp-")]


def test_build_killed_midway_leaves_nothing_the_next_build_keeps(tmp_path):
    cache, src, gate = tmp_path / "cache", _tiny(tmp_path / "src", 4), tmp_path / "gate"
    env = dict(os.environ, CXX=_wrapper(tmp_path, "cc 1.0", gate))
    gate.touch()
    p = _start(src, cache, env)
    pid_file, compiler_pid = pathlib.Path(f"{gate}.pid"), None
    try:
        while not pid_file.exists():  # wait for the event "the compile has begun" (no time limit)
            assert p.poll() is None, p.communicate()
            time.sleep(0.05)
        compiler_pid = int(pid_file.read_text())
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        if compiler_pid is not None:
            with contextlib.suppress(ProcessLookupError):  # gone with its group
                os.kill(compiler_pid, signal.SIGKILL)
    assert [n for n in os.listdir(cache) if n.startswith(".tmp-")], "the killed build left no temporary file"
    gate.unlink()
    answer, path = _finish(_start(src, cache, env))
    assert answer == 4
    assert os.listdir(cache) == [os.path.basename(path)]


def test_compile_error_names_the_compiler_and_leaves_nothing(tmp_path):
    src = tmp_path / "bad.cpp"
    src.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="failed"):
        compile_library(str(src), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []


def test_load_library_names_a_missing_or_broken_source(tmp_path):
    """native / island ``load_library`` (bench/kernel_ab.py loads another checkout with it):
    a missing or uncompilable file gives None and a message naming the file, and leaves the
    process's own kernel and its status alone."""
    from dal.formats import island, native
    before = native.status(), island.status()
    missing = str(tmp_path / "nowhere.cpp")
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    for load in (native.load_library, island.load_library):
        for source in (missing, str(bad)):
            lib, why = load(source)
            assert lib is None and source in why, why
    assert (native.status(), island.status()) == before


def test_load_library_of_this_tree_matches_the_process_kernel():
    from dal.formats import native
    lib, why = native.load_library(str(ROOT / "dal" / "formats" / "csrc" / "fake_quant.cpp"))
    if native.library() is None:
        pytest.skip(f"no fused kernel here: {native.status()}")
    assert why == "built and loaded" and lib._name == native.library()._name  # the same cached build


def test_a_header_change_rebuilds(tmp_path):
    """A source including a header of its folder: editing the header gives another build, which
    the compiler compiles with the new header (the library answers the header's new value)."""
    import ctypes
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "value.h").write_text("#pragma once\nconstexpr int kValue = 3;\n")
    src = folder / "uses.cpp"
    src.write_text('#include "value.h"\nextern "C" int answer() { return kValue; }\n')
    first = compile_library(str(src), cache_dir=str(tmp_path / "cache"))
    (folder / "value.h").write_text("#pragma once\nconstexpr int kValue = 4;\n")
    second = compile_library(str(src), cache_dir=str(tmp_path / "cache"))
    assert first != second
    assert ctypes.CDLL(first).answer() == 3 and ctypes.CDLL(second).answer() == 4
