"""The native thread pool the ops run on: its size (``set_num_threads`` / ``get_num_threads``,
started on first use; MIXQRT_NUM_THREADS overrides the default, platform.topology.usable_cpus: the
affinity set capped by the cgroup CPU quota), a thread's share of it (``local_threads``), its hot
mode (``hot``), and the compiled kernels module every ops file calls (``_ops``, None when not built).
"""
from __future__ import annotations

import threading

import numpy as np

from mixqrt.errors import KernelError, MixqrtError
from mixqrt.platform import topology, tuning

try:
    from mixqrt._kernels import _ops
except ImportError:  # not built: everything falls back to numpy
    _ops = None
if _ops is not None:
    tuning.push(_ops)   # the C-side MIXQRT_* switches (mixqrt.platform.tuning), once


# ----------------------------------------------------------------------------- threads
def default_num_threads() -> int:
    """MIXQRT_NUM_THREADS if set (mixqrt.platform.tuning), else platform.topology.usable_cpus() (the one
    CPU-count policy)."""
    n = tuning.value("MIXQRT_NUM_THREADS")
    return n if n is not None else topology.usable_cpus()


_blas_limiter = None


def _limit_blas(n: int) -> None:
    """Keep numpy's BLAS single-threaded while mixqrt's pool owns the cores (threadpoolctl)."""
    global _blas_limiter
    if n <= 1:
        if _blas_limiter is not None:
            _blas_limiter.restore_original_limits()
            _blas_limiter = None
        return
    if _blas_limiter is not None:
        return
    try:
        from threadpoolctl import threadpool_limits
        _blas_limiter = threadpool_limits(limits=1, user_api="blas")
    except Exception:  # threadpoolctl missing or no BLAS found: nothing to limit
        _blas_limiter = None


def _worker_order() -> list[int]:
    """Every allowed CPU in the pool's pinning order (platform.affinity.worker_cpus: compact over
    NUMA nodes, one thread per core before SMT siblings); worker i runs on the i-th."""
    from mixqrt.platform import affinity
    allowed = topology.allowed_cpus()
    try:
        topo = topology.topology()
    except MixqrtError:          # an unreadable sysfs must not stop the kernels: plain CPU order
        topo = None
    return affinity.worker_cpus(len(allowed), topo, allowed)


def set_num_threads(n: int) -> int:
    """Restart the native pool with n threads (the calling thread counts as one); returns n."""
    n = int(n)
    if n < 1:
        raise KernelError(f"set_num_threads: need at least 1 thread, got {n}")
    if _ops is None:
        return 1
    global _pool_started
    if _pool_started and _ops.pool_size() == n:
        return n             # already running with n threads (Pipeline and Engine may both ask)
    got = _ops.pool_start(n, _worker_order())
    _pool_started = True
    _limit_blas(got)
    return got


_pool_started = False


def _start_pool() -> None:
    """Importing ops starts nothing: the pool starts on the first op that uses it."""
    if not _pool_started and _ops is not None:
        set_num_threads(default_num_threads())


def get_num_threads() -> int:
    _start_pool()
    return _ops.pool_size() if _ops is not None else 1


_local = threading.local()


class local_threads:
    """Pool parts for the ops the *calling thread* runs: 1 = on this thread only, the pool untouched
    (the GIL is released, so several Python threads can run products at once); n = at most n pool
    parts; None = the whole pool (the default). ``ops.local_threads(1)`` sets it for the rest of the
    thread; ``with ops.local_threads(1):`` restores the previous setting on exit."""

    def __init__(self, n: int | None):
        self._before = getattr(_local, "parts", 0)
        _local.parts = _threads(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _local.parts = self._before
        return False


def _parts() -> int:
    """This thread's pool parts (0: the whole pool); starts the pool when it will be used."""
    p = getattr(_local, "parts", 0)
    if p != 1 and not _pool_started:
        _start_pool()
    return p


class hot:
    """Hot mode of the pool: idle workers spin instead of futex-sleeping between jobs, so the ~100
    products of a decode step pay no wake-up each. ``ops.hot(True)`` switches it on (``False`` off);
    also a context manager (``with ops.hot():``) restoring the previous state. It burns the pool's
    cores while on: use it around a generation loop, not for an idle process."""

    def __init__(self, on: bool = True):
        self._before = is_hot()
        if _ops is not None:
            _ops.set_hot(bool(on))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if _ops is not None:
            _ops.set_hot(self._before)
        return False


def is_hot() -> bool:
    return bool(_ops.get_hot()) if _ops is not None else False



def _threads(threads) -> int:
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise KernelError(f"threads must be an int >= 1 (or None for the whole pool), got {threads!r}")
    return int(threads)
