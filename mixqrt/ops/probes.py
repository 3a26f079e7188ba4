"""Memory bandwidth probes (the C read patterns over a buffer larger than the last-level cache, on
the cores the pool's workers use): ``read_bandwidth``, ``read_bandwidth_patterns``."""
from __future__ import annotations

from mixqrt.ops.pool import _ops, _worker_order
from mixqrt.platform import topology


def probe_bytes(nbytes: int) -> int:
    """The probe's buffer: ``nbytes``, but at least 4x the machine's last-level cache
    (:func:`platform.topology.llc_bytes`), so that it reads memory, not the cache."""
    return max(int(nbytes), 4 * topology.llc_bytes())


def read_bandwidth(nbytes: int = 1 << 28, threads: int = 1, reps: int = 3) -> float:
    """Measured read bandwidth, bytes/s: the best of every read pattern of the C probe
    (:func:`read_bandwidth_patterns` reports each), over :func:`probe_bytes` (nbytes) bytes."""
    _ops.bw_set_cpus(_worker_order())      # the cores the pool's workers use, in their order
    return _ops.read_bandwidth(probe_bytes(nbytes), int(threads), int(reps))


def read_bandwidth_patterns(nbytes: int = 1 << 28, threads: int = 1, reps: int = 3) -> dict[str, float]:
    """Bytes/s per read pattern of the probe (one stream, several prefetched streams, AVX2 /
    AVX-512 wide and non-temporal loads where the CPU has them; hugepage-advised buffer at least 4x
    the last-level cache, threads pinned in the pool's order)."""
    _ops.bw_set_cpus(_worker_order())
    return _ops.read_bandwidth_all(probe_bytes(nbytes), int(threads), int(reps))

