"""The served .mxq changing under a running server.

The weights are an mmap of the file (MAP_SHARED): a `cp` over it rewrites the very pages the
kernels read, so the server would answer with garbage, and a truncation turns the next read of a
vanished page into SIGBUS. FileWatch notices: the identity of the mapped inode at load
(st_dev, st_ino, st_size, st_mtime_ns, by fstat of the mapping's own descriptor) is compared
again before every request and once per `interval` seconds by a daemon thread. On a difference
the server logs one error, closes its engine (running requests end) and answers 503 from then on.

Why a stat and not inotify: it needs no dependency, sees writes made through any path or mount
(inotify misses changes made by another host on a network filesystem), and costs about a
microsecond per request. What it cannot do is close the window between a write and the next
check: a request running while the file is rewritten can still produce garbage, and a truncation
in the middle of a step can still fault (docs/server.md). Replacing the file by rename (mixqrt's
own `save` and `quantize -o` do) is safe: the running server keeps the old inode, and the watch
logs once that the path now names another file.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref

log = logging.getLogger("mixqrt.serve")


def _identity(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileWatch:
    def __init__(self, path, fstat, *, on_change=None, interval: float = 1.0):
        """path: the served file; fstat(): os.stat_result of the mapped inode (Arena.stat);
        on_change(reason): called once, from whichever thread notices first."""
        self.path, self._fstat, self._on_change = os.fspath(path), fstat, on_change
        self.loaded = _identity(fstat())
        self.changed: str | None = None
        self._renamed_logged = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if interval > 0:
            ref = weakref.ref(self)
            threading.Thread(target=_poll, args=(ref, self._stop, interval), daemon=True,
                             name="mixqrt-file-watch").start()

    def check(self) -> str | None:
        """None while the mapped file is as loaded; else why it is not (sticky)."""
        if self.changed is not None:
            return self.changed
        try:
            now = _identity(self._fstat())
        except OSError as e:
            now = ("error", str(e))
        if now == self.loaded:
            self._check_path()
            return None
        with self._lock:
            if self.changed is not None:
                return self.changed
            was, size = self.loaded, now[2] if len(now) == 4 else None
            what = ("truncated" if size is not None and size < was[2] else
                    "resized" if size is not None and size != was[2] else "rewritten in place")
            self.changed = f"{self.path} was {what} while being served ({was[2]} -> {size} bytes)"
        log.error("%s: no longer answering from it (503); restart the server on a complete file", self.changed)
        if self._on_change is not None:
            self._on_change(self.changed)
        self._stop.set()
        return self.changed

    def _check_path(self) -> None:
        if self._renamed_logged:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) != self.loaded[:2]:
            self._renamed_logged = True
            log.warning("%s now names another file; this server keeps serving the one it loaded "
                        "(restart it to serve the new one)", self.path)

    def close(self) -> None:
        self._stop.set()


def _poll(ref, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        w = ref()
        if w is None:
            return
        try:
            if w.check() is not None:
                return
        finally:
            del w


def watch_pipeline(pipe, on_change=None, interval: float = 1.0) -> FileWatch | None:
    """A FileWatch on the .mxq a Pipeline maps, or None for a pipe without one (tests' fakes)."""
    arena = getattr(getattr(getattr(pipe, "loaded", None), "file", None), "arena", None)
    if arena is None or not hasattr(arena, "stat"):
        return None
    return FileWatch(pipe.path, arena.stat, on_change=on_change, interval=interval)
