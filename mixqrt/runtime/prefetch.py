"""A background thread that madvise(WILLNEED)s the next layers' weight spans ahead of the model.

The model calls ``advance(i)`` just before running layer i; the thread then advises spans
i+1 .. i+ahead (wrapping to layer 0 after the last, since decoding loops over the layers once per
token). ``advance`` never blocks: it records the newest request and wakes the thread; if the model
runs faster than the thread, stale requests are dropped rather than queued.

WILLNEED on a file mapping starts asynchronous readahead into the page cache, so a cold model's
first token does not stall on page faults layer after layer; on a warm page cache it costs one
cheap syscall per span. The call goes through ctypes (affinity.madvise), which drops the GIL.
``realtime=True`` asks for SCHED_FIFO, which needs CAP_SYS_NICE; without it the thread falls back
silently to normal scheduling (``stats['realtime']`` says which). It is off by default because
normal users and containers lack the capability and a spinning real-time thread can starve the
workers on a small machine (docs/runtime.md).
"""
from __future__ import annotations

import os
import threading
import weakref

from mixqrt.errors import MixqrtError
from mixqrt.platform import affinity


class _State:
    """Everything the thread touches, so the thread holds no reference to the Prefetcher."""

    def __init__(self, base, size, spans, ahead, wrap, advice):
        self.base, self.size, self.spans = base, size, spans
        self.ahead, self.wrap, self.advice = ahead, wrap, advice
        self.cond = threading.Condition()
        self.want: int | None = None     # newest layer index from advance()
        self.requests = 0                # advance() calls so far
        self.done_requests = 0           # requests the thread has finished (or dropped as stale)
        self.stop = False
        self.recent: list[int] = []      # last `ahead` advised indices, to skip repeats
        self.log: list[tuple[int, int]] = []  # (request number, span index), bounded
        self.stats = {"advised": 0, "bytes": 0, "errors": 0, "last_errno": 0, "dropped": 0,
                      "realtime": False}


def _targets(st: _State, layer: int) -> list[int]:
    n = len(st.spans)
    out = []
    for k in range(1, st.ahead + 1):
        j = layer + k
        if j >= n:
            if not st.wrap:
                break
            j %= n
        if j not in out and j != layer:
            out.append(j)
    return out


def _run(st: _State, cpus, realtime):
    if cpus:
        try:
            os.sched_setaffinity(0, list(cpus))
        except OSError:
            pass
    if realtime and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            st.stats["realtime"] = True
        except OSError:  # EPERM without CAP_SYS_NICE: normal scheduling
            pass
    while True:
        with st.cond:
            while st.want is None and not st.stop:
                st.cond.wait()
            if st.stop:
                return
            layer, req = st.want, st.requests
            st.want = None
        for j in _targets(st, layer):
            if j in st.recent:
                continue
            off, nbytes = st.spans[j]
            addr, length = affinity.page_align_outward(st.base + off, nbytes)
            err = affinity.madvise(addr, length, st.advice)
            with st.cond:
                if err:
                    st.stats["errors"] += 1
                    st.stats["last_errno"] = err
                else:
                    st.stats["advised"] += 1
                    st.stats["bytes"] += length
                st.recent.append(j)
                del st.recent[:-max(1, st.ahead)]
                if len(st.log) < 100_000:
                    st.log.append((req, j))
            if st.stop:
                return
        with st.cond:
            st.stats["dropped"] += req - st.done_requests - 1
            st.done_requests = req
            st.cond.notify_all()


def _shutdown(st: _State, thread: threading.Thread):
    with st.cond:
        st.stop = True
        st.cond.notify_all()
    if thread.is_alive() and thread is not threading.current_thread():
        thread.join(5.0)


class Prefetcher:
    """Advise the kernel to read spans ahead of use. ``spans``: (offset, nbytes) per layer, in order.

    Use as a context manager or call ``close()``; the thread is a daemon and also stops when the
    Prefetcher is garbage-collected.
    """

    def __init__(self, mm, spans, ahead: int = 1, *, wrap: bool = True, cpus=None,
                 realtime: bool = False, advice: int = affinity.MADV_WILLNEED):
        if not isinstance(ahead, int) or ahead < 1:
            raise MixqrtError(f"Prefetcher: ahead must be an int >= 1, got {ahead!r}")
        base, size = affinity.buffer_address(mm)
        checked = []
        for i, sp in enumerate(spans):
            try:
                off, nbytes = int(sp[0]), int(sp[1])
            except (TypeError, ValueError, IndexError):
                raise MixqrtError(f"Prefetcher: span {i} must be (offset, nbytes), got {sp!r}") from None
            if off < 0 or nbytes < 0 or off + nbytes > size:
                raise MixqrtError(f"Prefetcher: span {i} [{off}, {off + nbytes}) is outside the "
                                  f"{size}-byte mapping")
            checked.append((off, nbytes))
        self._mm = mm  # keeps the mapping alive while the thread may advise it
        self._st = _State(base, size, checked, ahead, wrap, advice)
        self._thread = threading.Thread(target=_run, args=(self._st, cpus, realtime),
                                        name="mixqrt-prefetch", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._st, self._thread)

    @property
    def n_spans(self) -> int:
        return len(self._st.spans)

    @property
    def stats(self) -> dict:
        with self._st.cond:
            return dict(self._st.stats)

    @property
    def log(self) -> list[tuple[int, int]]:
        """(request number, span index) for each advice issued, in order (first 100k)."""
        with self._st.cond:
            return list(self._st.log)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def advance(self, layer_index: int) -> None:
        """The model is about to run ``layer_index``: advise the next span(s). Never blocks."""
        st = self._st
        if not 0 <= layer_index < len(st.spans):
            raise MixqrtError(f"Prefetcher.advance: layer {layer_index} outside 0..{len(st.spans) - 1}")
        with st.cond:
            if st.stop:
                raise MixqrtError("Prefetcher.advance after close()")
            st.requests += 1
            st.want = layer_index
            st.cond.notify_all()

    def wait(self, timeout: float | None = 5.0) -> bool:
        """Block until every advance() so far has been handled; False on timeout (tests, benchmarks)."""
        st = self._st
        with st.cond:
            return st.cond.wait_for(lambda: st.done_requests >= st.requests or st.stop, timeout)

    def close(self) -> None:
        """Stop and join the thread. Idempotent."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
