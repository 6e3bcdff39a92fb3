"""A folder of compiled libraries that any number of processes, checkouts and venvs can share.

Layout under a cache root::

    <root>/<name>/<file>            a finished build (name carries the hash of its inputs)
    <root>/<name>/key.json          the inputs that were hashed, for "why did it rebuild?"
    <root>/<name>.lock              advisory lock (flock) held while <name> is being built
    <root>/.tmp-<name>-<pid>-<host>-<random>/   the private folder of one build in progress

Contract of :func:`get_or_build`:

* A finished build is published by one ``rename`` of a complete folder, so a reader sees
  either no ``<root>/<name>`` or a whole one; nothing is ever rewritten in place.
* Every build compiles in its own private folder: two builds never share a ``build.ninja``
  or an object file, whatever the timing.
* Builders of the same name take ``<name>.lock`` with ``flock``: the second one waits
  (saying so once) and then loads the first one's result instead of compiling again. The
  kernel releases a flock when its holder dies, even by SIGKILL, so a lock is never stale.
  Where flock is unavailable the builds run in parallel and the first rename wins; the
  others use its result (identical inputs give an equivalent binary).
* A build killed midway leaves only its private folder. The next builder of that name
  removes it (saying so) when its process is gone: same host and dead pid, or any host
  and older than a day.

Only the standard library is used, and nothing happens at import.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from typing import Any, Callable

_ABANDONED_AFTER_S = 24 * 3600  # a private folder from another host: assume dead after a day


def say(message: str) -> None:
    """Print one progress line to stderr (the build's only output; never on a cache hit)."""
    print(message, file=sys.stderr, flush=True)


def _host() -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in socket.gethostname()) or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    return True


def _tmp_prefix(name: str) -> str:
    return f".tmp-{name}-"


def remove_abandoned(root: str, name: str) -> list[str]:
    """Delete the private folders of builds of ``name`` whose process is gone; return them.

    A folder ``.tmp-<name>-<pid>-<host>-<random>`` is abandoned when ``host`` is this host and
    ``pid`` is not running, or when it is older than a day (another host's pid cannot be
    checked). Each removal is reported on stderr.
    """
    removed = []
    prefix, host = _tmp_prefix(name), _host()
    try:
        entries = os.listdir(root)
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        path = os.path.join(root, entry)
        pid_s, _, rest = entry[len(prefix):].partition("-")
        owner_host = rest.rpartition("-")[0]
        try:
            pid, age = int(pid_s), time.time() - os.path.getmtime(path)
        except (ValueError, OSError):
            continue
        if pid == os.getpid() and owner_host == host:
            continue
        dead = (owner_host == host and not _pid_alive(pid)) or age > _ABANDONED_AFTER_S
        if dead:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            say(f"dal.npu: removed the unfinished build of a process that is gone (pid {pid} on "
                f"{owner_host}): {path}")
    return removed


@contextlib.contextmanager
def exclusive(lock_path: str, on_wait: Callable[[str], None]):
    """Hold an exclusive ``flock`` on ``lock_path`` for the ``with`` block.

    When another process holds it, ``on_wait(holder)`` is called once (``holder`` is what that
    process wrote into the file: its pid and host) and this one blocks until the lock is
    released, which the kernel does when the holder exits or is killed. Where flock is not
    supported (no fcntl, or a filesystem refusing locks) the block runs unlocked.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic publish alone keeps results whole
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. ENOLCK on some network filesystems
            locked = False
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {_host()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _publish(stage: str, final: str, lib: str, trash: str) -> None:
    """Rename the complete folder ``stage`` to ``final``; a finished ``final`` wins."""
    if os.path.isdir(final) and not os.path.exists(lib):
        os.rename(final, trash)  # a damaged entry (its library deleted by hand): replace it
    try:
        os.rename(stage, final)
    except OSError:
        if not os.path.exists(lib):  # not "someone else finished first": a real failure
            raise


def get_or_build(root: str, name: str, filename: str, build: Callable[[str], tuple[str, Any]],
                 key: dict, message: str) -> tuple[str, Any]:
    """Return ``(path of <root>/<name>/<filename>, payload)``, building it if it is missing.

    ``build(folder)`` is called only when no finished build exists, after ``message`` has been
    printed (once per build), with a fresh private folder to build in; it returns the path of
    the library it produced (inside that folder) and any payload (e.g. the module it loaded).
    The library is moved into place by a rename, which keeps a library that ``build`` already
    loaded valid. ``payload`` is None when the library came from the cache (the caller loads
    it). ``key`` is written next to the library as key.json. Exceptions of ``build`` propagate
    and leave nothing behind.
    """
    final = os.path.join(root, name)
    lib = os.path.join(final, filename)
    if os.path.exists(lib):
        return lib, None
    os.makedirs(root, exist_ok=True)
    waited = []

    def on_wait(holder: str) -> None:
        waited.append(holder)
        say(f"dal.npu: waiting for {holder}, which is compiling {name} (the result will be shared)")

    with exclusive(os.path.join(root, name + ".lock"), on_wait):
        if os.path.exists(lib):  # built by the process we waited for, or by a racing one
            return lib, None
        remove_abandoned(root, name)
        tmp = tempfile.mkdtemp(prefix=f"{_tmp_prefix(name)}{os.getpid()}-{_host()}-", dir=root)
        try:
            say(message)
            produced, payload = build(os.path.join(tmp, "build"))
            stage = os.path.join(tmp, "out")
            os.mkdir(stage)
            os.replace(produced, os.path.join(stage, filename))
            with open(os.path.join(stage, "key.json"), "w") as f:
                json.dump(key, f, indent=1, sort_keys=True)
            _publish(stage, final, lib, os.path.join(tmp, "old"))
            return lib, payload
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
