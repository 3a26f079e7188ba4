"""Prefetcher: advises spans ahead of a consumer on a real mmap'd file; stops cleanly."""
import ctypes
import mmap
import os
import threading
import time

import pytest

from mixqrt.errors import MixqrtError
from mixqrt.platform import affinity
from mixqrt.runtime.prefetch import Prefetcher

PAGE = mmap.PAGESIZE
N_LAYERS = 6
SPAN = 16 * PAGE


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        for i in range(N_LAYERS):
            f.write(bytes([i]) * SPAN)
        f.write(b"tail")  # file ends mid-page, like a real .mxq
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    spans = [(i * SPAN, SPAN) for i in range(N_LAYERS)]
    yield path, mm, spans
    mm.close()


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "mixqrt-prefetch"]


def test_advises_next_span_ahead_of_consumer(weights):
    _, mm, spans = weights
    with Prefetcher(mm, spans, ahead=1) as pf:
        assert pf.alive and pf.n_spans == N_LAYERS
        for token in range(2):
            for layer in range(N_LAYERS):
                pf.advance(layer)
                assert pf.wait(5)
                # the next layer (wrapping to 0 for the next token) is advised before it is used
                assert pf.log[-1][1] == (layer + 1) % N_LAYERS
                assert mm[spans[layer][0]] == layer  # the "model" reads its layer
        st = pf.stats
        assert st["errors"] == 0 and st["advised"] == 2 * N_LAYERS and st["bytes"] >= 2 * N_LAYERS * SPAN
    assert not pf.alive and not _prefetch_threads()


def test_ahead_two_no_wrap(weights):
    _, mm, spans = weights
    pf = Prefetcher(mm, spans, ahead=2, wrap=False)
    pf.advance(0)
    pf.wait()
    assert [j for _, j in pf.log] == [1, 2]
    pf.advance(1)
    pf.wait()
    assert [j for _, j in pf.log] == [1, 2, 3]  # 2 was just advised: not repeated
    pf.advance(N_LAYERS - 1)
    pf.wait()
    assert [j for _, j in pf.log] == [1, 2, 3]  # nothing after the last layer without wrap
    pf.close()
    pf.close()  # idempotent
    assert not _prefetch_threads()


def test_unaligned_spans_are_widened(weights):
    _, mm, _ = weights
    spans = [(0, 100), (PAGE + 123, 3 * PAGE), (len(mm) - 4, 4)]
    with Prefetcher(mm, spans) as pf:
        pf.advance(0)
        pf.advance(1)
        assert pf.wait()
        assert pf.stats["errors"] == 0


def test_advance_never_blocks_and_drops_stale(weights):
    _, mm, spans = weights
    with Prefetcher(mm, spans) as pf:
        t0 = time.perf_counter()
        for _ in range(200):
            for layer in range(N_LAYERS):
                pf.advance(layer)
        elapsed = time.perf_counter() - t0
        assert pf.wait(5)
        st = pf.stats
        assert st["advised"] + st["dropped"] >= 1 and st["errors"] == 0
        assert elapsed < 2.0


def test_close_with_pending_work_and_gc(weights):
    _, mm, spans = weights
    pf = Prefetcher(mm, spans, ahead=3)
    pf.advance(2)
    pf.close()
    assert not pf.alive
    with pytest.raises(MixqrtError, match="after close"):
        pf.advance(0)
    pf2 = Prefetcher(mm, spans)
    th = pf2._thread
    del pf2  # the finalizer stops the thread
    th.join(5)
    assert not th.is_alive() and not _prefetch_threads()


def test_bad_arguments(weights):
    _, mm, spans = weights
    with pytest.raises(MixqrtError):
        Prefetcher(mm, spans, ahead=0)
    with pytest.raises(MixqrtError, match="outside"):
        Prefetcher(mm, [(len(mm) - 10, 20)])
    with pytest.raises(MixqrtError, match="span 0"):
        Prefetcher(mm, [(1,)])
    with Prefetcher(mm, spans) as pf:
        with pytest.raises(MixqrtError):
            pf.advance(N_LAYERS)
    assert not _prefetch_threads()


def test_realtime_request_falls_back(weights):
    _, mm, spans = weights
    with Prefetcher(mm, spans, realtime=True, cpus=sorted(os.sched_getaffinity(0))[:1]) as pf:
        pf.advance(0)
        assert pf.wait()
        assert pf.stats["realtime"] in (True, False)  # True only with CAP_SYS_NICE
    assert not _prefetch_threads()


def _resident(mm, off, nbytes):
    libc = ctypes.CDLL(None, use_errno=True)
    addr, _ = affinity.buffer_address(mm)
    a, n = affinity.page_align_outward(addr + off, nbytes)
    vec = (ctypes.c_ubyte * (n // PAGE))()
    if libc.mincore(ctypes.c_void_p(a), ctypes.c_size_t(n), vec) != 0:
        return None
    return sum(v & 1 for v in vec) / len(vec)


def test_willneed_brings_pages_in(weights):
    """Where the page cache can be dropped (not tmpfs), WILLNEED reads the next span back in."""
    path, mm, spans = weights
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    before = _resident(mm, *spans[3])
    if before is None or before > 0:
        pytest.skip(f"cannot evict the test file's pages here (resident fraction {before})")
    with Prefetcher(mm, spans) as pf:
        pf.advance(2)
        assert pf.wait()
        deadline = time.time() + 5
        while _resident(mm, *spans[3]) < 1.0 and time.time() < deadline:
            time.sleep(0.01)
        assert _resident(mm, *spans[3]) == 1.0
        assert _resident(mm, *spans[5]) < 1.0  # not asked for
