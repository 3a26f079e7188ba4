"""Atomic file writes that survive concurrency and crashes: unique temp names, lock files, and
cleanup of the temps a killed writer leaves behind.

Every writer creates its temp file next to the target (same filesystem, so os.replace is atomic)
named ``.<target>.<pid>.<random>.tmp``: two writers never share a temp, and the pid tells a later
run whether the writer is still alive. A SIGKILL skips every `finally`, so the temp of a killed
writer stays; `clean_stale_temps` removes those whose writer is gone.
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

# .<target>.<pid>.<random>.tmp (mkstemp's random part has no dots)
_TEMP = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[^.]+\.tmp$")
STALE_AGE_S = 24 * 3600        # a temp without a live pid is also stale once this old


def umask() -> int:
    """The process umask, read without os.umask()'s set-and-restore race between threads."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def mkstemp_for(path) -> tuple[int, str]:
    """(fd, temp path) for an atomic write of `path`: same folder, unique, pid in the name, and
    the permissions a plain open() would give (mkstemp's 0600 would survive the rename)."""
    path = os.path.abspath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", suffix=".tmp",
                               dir=os.path.dirname(path))
    os.fchmod(fd, 0o666 & ~umask())
    return fd, tmp


@contextmanager
def atomic_write(path, mode: str = "wb", *, encoding: str | None = None, fsync: bool = True):
    """The one way mixqrt writes a file: yields a file object on a temp next to `path`
    (mkstemp_for); on a clean exit it is flushed, fsynced and renamed onto `path`, on any exception
    (KeyboardInterrupt too) removed. A reader never sees a half-written file; a SIGKILLed writer
    leaves a temp that clean_stale_temps recognises."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write: mode must be 'wb' or 'w', not {mode!r}")
    path = os.fspath(path)
    fd, tmp = mkstemp_for(path)
    try:
        with os.fdopen(fd, mode, encoding=encoding if mode == "w" else None) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def lock_path(path) -> Path:
    """Where `path`'s lock file lives: the cache folder's locks/ (platform.files.cache_dir), named by
    a hash of the absolute path and its file name, so nothing is left beside the user's files."""
    import hashlib

    from mixqrt.platform.files import cache_dir
    full = os.path.abspath(os.fspath(path))
    key = hashlib.sha256(full.encode("utf-8", "surrogateescape")).hexdigest()[:24]
    d = cache_dir() / "locks"
    d.mkdir(exist_ok=True)
    return d / f"{key}-{os.path.basename(full)[:80]}.lock"


def file_lock(path, timeout: float = -1):
    """An inter-process lock (filelock.FileLock on lock_path(path), in the cache folder) serialising
    writers of `path`. The lock is an fcntl lock, released by the kernel when its holder dies, even
    by SIGKILL."""
    from filelock import FileLock
    return FileLock(str(lock_path(path)), timeout=timeout)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # exists, owned by someone else
        return True
    return True


def clean_stale_temps(folder, *, max_age_s: float = STALE_AGE_S, held=()) -> list[Path]:
    """Remove writer temps in `folder` whose writer is gone; returns what was removed.

    A temp is stale when its pid is not running (and it is not ours), or, for a pid that is
    running (pids get reused), when it is older than max_age_s and the target's lock is free.
    A temp whose target's lock is held by someone else is never touched: its writer may still be
    working. `held`: target paths whose lock the caller holds (a second FileLock on the same file
    in one process would wait on it): their stale temps are removed without taking the lock.
    """
    from filelock import Timeout
    mine = {os.path.abspath(os.fspath(p)) for p in held}
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        m = _TEMP.match(e.name)
        if not m or not e.is_file(follow_symlinks=False):
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid():
            continue
        try:
            old = now - e.stat(follow_symlinks=False).st_mtime > max_age_s
        except OSError:
            continue
        if _pid_alive(pid) and not old:
            continue
        target = os.path.abspath(os.path.join(folder, m.group("target")))
        try:
            if target in mine:
                os.unlink(e.path)
            else:
                with file_lock(target, timeout=0):
                    os.unlink(e.path)
            removed.append(Path(e.path))
        except Timeout:
            continue              # someone is writing that target right now
        except OSError:
            continue
    return removed


@contextmanager
def output_lock(path):
    """Hold `path`'s lock (file_lock) for writing it, after removing the temps that killed writers
    left in its folder, its own included (clean_stale_temps with held=path). Every long writer of
    a file (`mixqrt quantize -o`, the cache's quantize in prepare(), Pipeline.save) goes through
    here, so a run after a SIGKILL leaves nothing of the killed one behind."""
    with file_lock(path):
        clean_stale_temps(os.path.dirname(os.path.abspath(os.fspath(path))), held=(path,))
        yield


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by the SIGTERM handler of terminate_as_interrupt()."""


_TERMINATED = []           # set by the SIGTERM handler: the raise can land in code that swallows it


def was_terminated() -> bool:
    """True once SIGTERM arrived. An exception raised by a signal handler while Python runs a
    finalizer is printed ("Exception ignored in ...") and dropped, so long-running code (the
    server's start) checks this too instead of trusting the raise alone."""
    return bool(_TERMINATED)


def terminate_as_interrupt() -> None:
    """SIGTERM raises Terminated (a KeyboardInterrupt) in the main thread, as Ctrl-C does, so
    `finally` blocks and writers' aborts remove their temps instead of the process vanishing.
    Only from the main thread, and only where SIGTERM still has its default action."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def _raise(signum, frame):
        _TERMINATED.append(signum)
        raise Terminated(f"signal {signum}")
    signal.signal(signal.SIGTERM, _raise)
