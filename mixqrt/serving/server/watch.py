"""The served .mxq changing under a running server.

`mixqrt serve` reads the weights into private memory (Pipeline(weights_in_memory=True), docs/
server.md "The served file"): a `cp` over the file, a truncation, anything done to it afterwards
changes nothing that is served. FileWatch then only logs, once, that the file on disk is no longer
what is being served (`fatal=False`).

A server over a mapping of the file (the library's default, or `mixqrt serve --mmap-weights`)
cannot say the same: a `cp` over it rewrites the very pages the kernels read, so the server would
answer with garbage, and a truncation turns the next read of a vanished page into SIGBUS. FileWatch
notices: the identity of the mapped inode at load (st_dev, st_ino, st_size, st_mtime_ns and
st_ctime_ns, by fstat of the mapping's own descriptor: io.arena.file_identity; a rewrite with the
old mtime restored still moves the ctime) is compared again before every request and once per
`interval` seconds by a daemon thread. On a difference the server logs one error, closes its
engine (running streams end with an error event and [DONE]) and answers 503 from then on.

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

from mixqrt.io.arena import file_identity as _identity

log = logging.getLogger("mixqrt.serving.server")




class FileWatch:
    def __init__(self, path, fstat, *, on_change=None, interval: float = 1.0, fatal: bool = True):
        """path: the served file; fstat(): os.stat_result of the mapped inode (Arena.stat);
        on_change(reason): called once, from whichever thread notices first (fatal only);
        fatal=False: the weights are a private copy, a change is logged once and check() stays None."""
        self.path, self._fstat, self._on_change = os.fspath(path), fstat, on_change
        self.fatal = bool(fatal)
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
            was, size = self.loaded, now[2] if len(now) == 5 else None
            what = ("truncated" if size is not None and size < was[2] else
                    "resized" if size is not None and size != was[2] else "rewritten in place")
            why = f"{self.path} was {what} while being served ({was[2]} -> {size} bytes)"
            if not self.fatal:
                self.loaded = now                   # log each change once, keep serving the copy
            else:
                self.changed = why
        if not self.fatal:
            log.warning("%s; still serving the weights read at load (restart the server to serve the "
                        "new file)", why)
            return None
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
    return FileWatch(pipe.path, arena.stat, on_change=on_change, interval=interval,
                     fatal=not getattr(arena, "copied", False))
