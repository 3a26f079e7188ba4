"""Thread pinning and the Linux memory-policy syscalls (mbind, set_mempolicy) and madvise, via ctypes.

Nothing here raises on a kernel refusal: the syscall wrappers return 0 or an errno, and callers
(placement.apply_placement, the prefetcher) report it. Only bad arguments raise MixqrtError.
Ranges passed to mbind/madvise must be page-aligned; ``page_align_inward`` / ``page_align_outward``
make them so.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import platform
import threading

from mixqrt.errors import MixqrtError
from mixqrt.platform.topology import allowed_cpus, usable_cpus  # noqa: F401  (re-exported for callers)
from mixqrt.platform.topology import core_first, cores_together

PAGE_SIZE = mmap.PAGESIZE

# <linux/mempolicy.h>
MPOL_DEFAULT = 0
MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_MF_STRICT = 1 << 0
MPOL_MF_MOVE = 1 << 1

# syscall numbers by machine: (mbind, set_mempolicy)
_SYSCALLS = {"x86_64": (237, 238), "aarch64": (235, 237), "riscv64": (235, 237)}
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)

_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c") or "libc.so.6"
        _libc = ctypes.CDLL(name, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc


def numa_syscalls_available() -> bool:
    return platform.system() == "Linux" and platform.machine() in _SYSCALLS


# --- threads -----------------------------------------------------------------------------------

def pin_current_thread(cpus) -> tuple[int, ...]:
    """Restrict the calling thread (not the process) to ``cpus``; returns its previous CPU set.

    Linux applies sched_setaffinity(0, ...) to the calling thread only, so each worker pins itself.
    """
    if not hasattr(os, "sched_setaffinity"):
        raise MixqrtError("thread pinning needs sched_setaffinity (Linux)")
    want = sorted({int(c) for c in cpus})
    if not want:
        raise MixqrtError("pin_current_thread: empty CPU set")
    prev = tuple(sorted(os.sched_getaffinity(0)))
    try:
        os.sched_setaffinity(0, want)
    except OSError as e:
        raise MixqrtError(f"cannot pin thread to CPUs {want}: {e.strerror} "
                          f"(allowed here: {list(prev)})") from None
    return prev


@contextlib.contextmanager
def pinned(cpus):
    """Run a block with the calling thread pinned to ``cpus``, restoring its CPU set afterwards."""
    prev = pin_current_thread(cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, prev)


def _node_groups(allowed: list[int], topo) -> list[list[int]]:
    """Allowed CPUs by NUMA node, the node with the most allowed CPUs first; CPUs no node claims last."""
    if topo is None or not topo.is_numa:
        return [allowed]
    groups = []
    for node in topo.cpu_nodes:
        cs = [c for c in node.cpus if c in set(allowed)]
        if cs:
            groups.append(cs)
    claimed = {c for g in groups for c in g}
    groups.sort(key=len, reverse=True)
    leftover = [c for c in allowed if c not in claimed]
    return groups + ([leftover] if leftover else [])


def worker_cpus(n_threads: int, topo=None, allowed=None, sysfs_root=None) -> list[int]:
    """One CPU per worker, in the order the native pool pins them (``ops.set_num_threads``): the
    node with the most allowed CPUs first (compact placement), and inside a node one hardware thread
    of every core before any core's SMT sibling (``topology.core_first``).

    Compact keeps a small thread count on one memory controller, so first-touch lands weights on
    the node that reads them; core-first keeps two lock-step workers off one core's ports. Returns
    fewer than ``n_threads`` CPUs if fewer are allowed.
    """
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    root = sysfs_root if sysfs_root is not None else getattr(topo, "root", None)
    order = [c for g in _node_groups(allowed, topo) for c in core_first(g, root)]
    return order[:n_threads]


def compact_cpus(topo=None, allowed=None, sysfs_root=None) -> list[int]:
    """Every allowed CPU, node-filling (as :func:`worker_cpus`) with each core's hardware threads
    side by side: contiguous runs are whole cores on as few nodes as possible (splitting a
    machine between replicas, ``serve.ray.core_sets``)."""
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    root = sysfs_root if sysfs_root is not None else getattr(topo, "root", None)
    return [c for g in _node_groups(allowed, topo) for c in cores_together(g, root)]


# --- addresses ---------------------------------------------------------------------------------

def buffer_address(obj) -> tuple[int, int]:
    """(address, length) of an mmap, numpy array, or any buffer; read-only buffers work too."""
    if isinstance(obj, int):
        raise MixqrtError("buffer_address: got a bare address; pass (address, length)")
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, int) for v in obj):
        return obj
    import numpy as np
    try:
        arr = np.frombuffer(obj, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise MixqrtError(f"cannot take the address of {type(obj).__name__}: {e}") from None
    return int(arr.ctypes.data), int(arr.nbytes)


def page_align_inward(addr: int, length: int) -> tuple[int, int]:
    """Largest page-aligned range inside [addr, addr+length): never touches a neighbour's page."""
    start = -(-addr // PAGE_SIZE) * PAGE_SIZE
    end = (addr + length) // PAGE_SIZE * PAGE_SIZE
    return start, max(0, end - start)


def page_align_outward(addr: int, length: int) -> tuple[int, int]:
    """Smallest page-aligned range covering [addr, addr+length) (fine for advice, not for binding)."""
    start = addr // PAGE_SIZE * PAGE_SIZE
    end = -(-(addr + length) // PAGE_SIZE) * PAGE_SIZE
    return start, end - start


# --- syscalls ----------------------------------------------------------------------------------

def _nodemask(nodes) -> tuple[ctypes.Array, int]:
    nodes = sorted(set(int(n) for n in nodes))
    if not nodes or nodes[0] < 0 or nodes[-1] >= 4096:
        raise MixqrtError(f"bad node set {nodes}")
    nbits = 64 * (nodes[-1] // 64 + 1)
    words = (ctypes.c_ulong * (nbits // 64))()
    for n in nodes:
        words[n // 64] |= 1 << (n % 64)
    # maxnode: the kernel reads maxnode-1 bits; pass one more than the mask holds
    return words, nbits + 1


def mbind(addr: int, length: int, nodes, mode: int = MPOL_BIND, flags: int = MPOL_MF_MOVE) -> int:
    """mbind(2) on a page-aligned range; returns 0 or the errno (never raises for kernel errors).

    MPOL_MF_MOVE migrates pages already present that only this process maps; pages faulted in
    later follow the policy (anonymous and private mappings; see docs/runtime.md for shared files).
    """
    if addr % PAGE_SIZE:
        raise MixqrtError(f"mbind: address {addr:#x} is not page-aligned")
    if length <= 0:
        return 0
    if not numa_syscalls_available():
        return 38  # ENOSYS
    mask, maxnode = _nodemask(nodes)
    libc = _get_libc()
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(_SYSCALLS[platform.machine()][0]), ctypes.c_ulong(addr),
                      ctypes.c_ulong(length), ctypes.c_ulong(mode), mask, ctypes.c_ulong(maxnode),
                      ctypes.c_uint(flags))
    return 0 if rc == 0 else (ctypes.get_errno() or 1)


def set_thread_mempolicy(mode: int, nodes=None) -> int:
    """set_mempolicy(2) for the calling thread; returns 0 or the errno. MPOL_DEFAULT takes no nodes."""
    if not numa_syscalls_available():
        return 38
    libc = _get_libc()
    ctypes.set_errno(0)
    nr = ctypes.c_long(_SYSCALLS[platform.machine()][1])
    if mode == MPOL_DEFAULT or not nodes:
        rc = libc.syscall(nr, ctypes.c_ulong(mode), None, ctypes.c_ulong(0))
    else:
        mask, maxnode = _nodemask(nodes)
        rc = libc.syscall(nr, ctypes.c_ulong(mode), mask, ctypes.c_ulong(maxnode))
    return 0 if rc == 0 else (ctypes.get_errno() or 1)


def madvise(addr: int, length: int, advice: int = MADV_WILLNEED) -> int:
    """madvise(2) through ctypes, so the GIL is released during the call; returns 0 or the errno."""
    if addr % PAGE_SIZE:
        raise MixqrtError(f"madvise: address {addr:#x} is not page-aligned")
    if length <= 0:
        return 0
    ctypes.set_errno(0)
    rc = _get_libc().madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice))
    return 0 if rc == 0 else (ctypes.get_errno() or 1)


def touch_pages(addr: int, length: int) -> int:
    """Read one byte per page so each page is faulted in by the calling thread; returns pages read."""
    start, n = page_align_outward(addr, length)
    if n == 0:
        return 0
    buf = (ctypes.c_char * n).from_address(start)
    import numpy as np
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[::PAGE_SIZE].sum()  # the reads are the point; numpy's loop releases nothing but is fast
    return n // PAGE_SIZE


def first_touch_on_node(addr: int, length: int, node: int, cpus=()) -> int:
    """Fault a range in from a helper thread whose memory policy prefers ``node``; 0 or errno.

    Works for CPU-less (CXL) nodes too, since it relies on the thread's policy rather than on
    running near the node; ``cpus`` additionally pins the helper (locality of the page tables).
    """
    result = [0]

    def run():
        try:
            if cpus:
                os.sched_setaffinity(0, list(cpus))
            rc = set_thread_mempolicy(MPOL_PREFERRED, [node])
            if rc:
                result[0] = rc
                return
            touch_pages(addr, length)
            set_thread_mempolicy(MPOL_DEFAULT)
        except OSError as e:
            result[0] = e.errno or 1

    t = threading.Thread(target=run, name=f"mixqrt-first-touch-{node}", daemon=True)
    t.start()
    t.join()
    return result[0]
