"""The C++ build of dal.npu: keyed cache, concurrent builders, killed builds, one message.

Real compiles in real processes, through the same build_extension that builds the kernels, of a
tiny pybind11 source (seconds, not minutes). A wrapper "compiler" that stops on its first compile
lets a test kill a build midway, at a known point, without timing assumptions.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dal.npu.build import BuildError, build_extension, cache_key, default_cache_dir, key_digest

ROOT = pathlib.Path(__file__).resolve().parents[2]
REAL_CXX = shutil.which(os.environ.get("CXX") or "c++")
pytestmark = pytest.mark.skipif(REAL_CXX is None, reason="no C++ compiler on this machine")
MARK = "COMPILING"  # the test's build message, to count compiles in a process's stderr
_BUILD = ("import sys; from dal.npu.build import build_extension; "
          f"m = build_extension('tiny', [sys.argv[1]], ['-O1'], cache_dir=sys.argv[2], message='{MARK} {{name}}'); "
          "print(m.answer(), m.__file__)")


def _tiny(folder: pathlib.Path, value: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "tiny.cpp"
    src.write_text("#include <pybind11/pybind11.h>\n"
                   f"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def(\"answer\", [] {{ return {value}; }}); }}\n")
    return str(src)


def _start(src: str, cache, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _BUILD, src, str(cache)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _finish(p: subprocess.Popen) -> tuple[int, str, str]:
    """(answer, library path, stderr) of a finished build process; fails with its output."""
    out, err = p.communicate()
    assert p.returncode == 0, err
    answer, path = out.split()
    return int(answer), path, err


def _leftovers(cache) -> list[str]:
    return [n for n in os.listdir(cache) if n.startswith(".tmp-")]


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns


def test_two_checkouts_build_at_once_and_never_rebuild_each_other(tmp_path):
    cache = tmp_path / "cache"
    a, b = _tiny(tmp_path / "checkout_a", 1), _tiny(tmp_path / "checkout_b", 2)
    first = [_finish(p) for p in [_start(a, cache), _start(b, cache)]]  # both run concurrently
    assert [r[0] for r in first] == [1, 2]
    assert [r[2].count(MARK) for r in first] == [1, 1]
    assert first[0][1] != first[1][1]
    stamps = [_stamp(r[1]) for r in first]
    again = [_finish(_start(a, cache)), _finish(_start(b, cache))]
    assert [r[0] for r in again] == [1, 2]
    assert [r[2].count(MARK) for r in again] == [0, 0], "a cached build was compiled again"
    assert [r[1] for r in again] == [r[1] for r in first]
    assert [_stamp(r[1]) for r in again] == stamps, "a finished build was rewritten"
    assert _leftovers(cache) == []


def test_same_build_started_twice_at_once_compiles_once(tmp_path):
    cache, src = tmp_path / "cache", _tiny(tmp_path / "src", 7)
    results = [_finish(p) for p in [_start(src, cache), _start(src, cache)]]
    assert [r[0] for r in results] == [7, 7]
    assert results[0][1] == results[1][1]
    assert sum(r[2].count(MARK) for r in results) == 1, [r[2] for r in results]
    assert _leftovers(cache) == []


def _blocking_compiler(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """A g++ wrapper that, while ``gate`` exists, stops at its first compile and writes its pid
    to ``started``; otherwise it is the real compiler. Returns (wrapper, gate, started)."""
    bindir, gate, started = tmp_path / "bin", tmp_path / "gate", tmp_path / "started"
    bindir.mkdir()
    wrapper = bindir / "g++"  # cpp_extension accepts a compiler whose path names g++
    wrapper.write_text(f"""#!/bin/sh
for a in "$@"; do
  if [ "$a" = "-c" ] && [ -e "{gate}" ]; then echo $$ > "{started}.tmp"; mv "{started}.tmp" "{started}"; exec sleep 1000000; fi
done
exec "{os.path.realpath(REAL_CXX)}" "$@"
""")
    wrapper.chmod(0o755)
    return wrapper, gate, started


def test_build_killed_midway_is_recovered_by_the_next(tmp_path):
    cache, src = tmp_path / "cache", _tiny(tmp_path / "src", 5)
    wrapper, gate, started = _blocking_compiler(tmp_path)
    env = dict(os.environ, CXX=str(wrapper))
    gate.touch()
    p = _start(src, cache, env)
    compiler_pid = None
    try:
        while not started.exists():  # wait for the event "the compile has begun" (no time limit)
            assert p.poll() is None, p.communicate()
            time.sleep(0.05)
        compiler_pid = int(started.read_text())
        os.killpg(p.pid, signal.SIGKILL)  # python and ninja; ninja puts compilers in their own group
        p.wait()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        if compiler_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(compiler_pid, signal.SIGKILL)
    assert len(_leftovers(cache)) == 1
    assert not [n for n in os.listdir(cache) if (cache / n).is_dir() and n.startswith("tiny_")], "published"
    gate.unlink()
    answer, path, err = _finish(_start(src, cache, env))  # would hang here if the lock were stale
    assert answer == 5
    assert "removed the unfinished build" in err and err.count(MARK) == 1, err
    assert _leftovers(cache) == []
    assert json.loads((pathlib.Path(path).parent / "key.json").read_text())["compiler"][0] == os.path.realpath(wrapper)


def test_cache_key_covers_sources_flags_and_compiler(tmp_path):
    a, same, b = _tiny(tmp_path / "a", 1), _tiny(tmp_path / "same", 1), _tiny(tmp_path / "b", 2)
    key = cache_key([a], ["-O1"])
    digest = key_digest(key)
    assert key_digest(cache_key([a], ["-O1"])) == digest
    assert key_digest(cache_key([same], ["-O1"])) == digest, "same sources elsewhere: one shared build"
    changed = {"source": cache_key([b], ["-O1"]), "cflags": cache_key([a], ["-O1", "-mavxvnni"]),
               "ldflags": cache_key([a], ["-O1"], ["-fopenmp"])}
    (tmp_path / "a" / "extra.h").write_text("// a header beside the source\n")
    changed["header"] = cache_key([a], ["-O1"])
    wrapper, _, _ = _blocking_compiler(tmp_path)
    changed["compiler"] = cache_key([a], ["-O1"], cxx=str(wrapper))
    assert {k: key_digest(v) == digest for k, v in changed.items()} == dict.fromkeys(changed, False)
    version = subprocess.run([REAL_CXX, "--version"], capture_output=True, text=True).stdout.strip()
    assert key["compiler"] == [os.path.realpath(REAL_CXX), version]
    import torch
    assert key["torch"] == [torch.__version__, str(torch.version.git_version),
                            f"cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    assert any(p.startswith(os.path.dirname(torch.__file__)) for p in key["torch_paths"])
    assert key["python"][0] == sys.version


def test_message_once_per_build_and_none_when_cached(tmp_path, capfd):
    cache, src = tmp_path / "cache", _tiny(tmp_path / "src", 11)
    m = build_extension("tiny", [src], ["-O1"], cache_dir=str(cache), message=MARK + " {name} into {dir}")
    again = build_extension("tiny", [src], ["-O1"], cache_dir=str(cache), message=MARK)
    assert m is again and m.answer() == 11
    assert m.__file__ == os.path.join(cache, m.__name__, m.__name__ + ".so")
    lines = [ln for ln in capfd.readouterr().err.splitlines() if MARK in ln]
    assert lines == [f"{MARK} {m.__name__} into {os.path.join(cache, m.__name__)}"]


def test_missing_ninja_is_a_build_error_naming_the_package(tmp_path, monkeypatch, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CXX", os.path.realpath(REAL_CXX))
    monkeypatch.setattr(sys, "executable", str(empty / "python"))  # no ninja beside "the venv" either
    monkeypatch.setitem(sys.modules, "ninja", None)  # nor the ninja package
    with pytest.raises(BuildError, match="pip install ninja"):
        build_extension("tiny", [_tiny(tmp_path / "src", 3)], cache_dir=str(tmp_path / "cache"), message=MARK)
    assert MARK not in capfd.readouterr().err


def test_missing_compiler_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(BuildError, match="C\\+\\+ compiler"):
        build_extension("tiny", [_tiny(tmp_path / "src", 3)], cache_dir=str(tmp_path / "cache"))


def test_npu_kernels_load_from_the_keyed_cache(npu_lib):
    folder = os.path.dirname(npu_lib.__file__)
    key = json.loads(open(os.path.join(folder, "key.json")).read())
    assert os.path.basename(folder) == npu_lib.__name__ == "dal_npu_" + key_digest(key)
    # No CPU-dependent flag: the build is for the x86-64 baseline, the kernel variants are chosen
    # at run time from cpuid (tests/npu/test_dispatch.py), so one build serves every CPU.
    assert not [f for f in key["cflags"] if f.startswith("-m") or f.startswith("-DDAL_NPU_")], key["cflags"]
    assert "-ffp-contract=off" in key["cflags"]
    assert os.path.dirname(folder) == default_cache_dir()


def test_compile_error_is_a_build_error_with_the_compiler_output(tmp_path):
    src = tmp_path / "bad.cpp"
    src.write_text("#include <pybind11/pybind11.h>\nthis_is_not_cpp;\n")
    cache = tmp_path / "cache"
    with pytest.raises(BuildError, match="this_is_not_cpp"):
        build_extension("bad", [str(src)], cache_dir=str(cache), message=MARK)
    assert [n for n in os.listdir(cache) if not n.endswith(".lock")] == [], "a failed build left files"
