"""Machine topology from sysfs: NUMA nodes, their CPUs, memory and distances; usable CPU count.

Everything reads from a root directory (``/sys`` by default, ``$MIXQRT_SYSFS`` if set), so tests and
``mixqrt inspect --placement`` can point at a fake tree and plan for 2-node or CXL machines on a
1-node box. Layout read (all optional except what a node needs)::

    ROOT/devices/system/cpu/online                 "0-3,8-11"
    ROOT/devices/system/node/nodeN/cpulist         "" for a CPU-less (CXL / far-memory) node
    ROOT/devices/system/node/nodeN/distance        "10 21" (SLIT row, ordered by node id)
    ROOT/devices/system/node/nodeN/meminfo         "Node N MemTotal:  123 kB" ...
    ROOT/devices/system/cpu/cpuN/topology/thread_siblings_list  "0,8" (cpuN's core: SMT siblings)
    ROOT/devices/system/cpu/cpuN/cache/indexI/{level,size,shared_cpu_list}  "3" "32768K" "0-7"

A kernel without NUMA (no node directory) is reported as one node holding every online CPU.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from mixqrt.errors import MixqrtError

DEFAULT_ROOT = "/sys"
LOCAL_DISTANCE = 10  # ACPI SLIT: distance of a node to itself


@dataclass(frozen=True, eq=False)
class Node:
    id: int
    cpus: tuple[int, ...]          # online CPUs of the node, sorted; () for a memory-only node
    mem_bytes: int                 # MemTotal of the node (0 if unknown)
    distances: dict[int, int] = field(default_factory=dict)  # node id -> SLIT distance
    has_cpu: bool = True

    def distance_to(self, other: int) -> int:
        return self.distances.get(other, LOCAL_DISTANCE if other == self.id else 2 * LOCAL_DISTANCE)


@dataclass(frozen=True, eq=False)
class Topology:
    nodes: list[Node]              # sorted by id
    online_cpus: tuple[int, ...]
    root: str = DEFAULT_ROOT
    numa_sysfs: bool = True        # False: the kernel exposed no node directory (single-node fallback)

    @property
    def is_numa(self) -> bool:
        return len(self.nodes) > 1

    @property
    def cpu_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.has_cpu]

    @property
    def memory_only_nodes(self) -> list[Node]:
        """CPU-less nodes with memory: CXL expanders, far/slow tiers (the "cxl" tier of placement.py)."""
        return [n for n in self.nodes if not n.has_cpu and n.mem_bytes > 0]

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise MixqrtError(f"topology has no node {node_id} (nodes: {[n.id for n in self.nodes]})")

    def node_of_cpu(self, cpu: int) -> int | None:
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        return None

    def distance(self, a: int, b: int) -> int:
        return self.node(a).distance_to(b)

    def nodes_of_cpus(self, cpus) -> list[int]:
        """Node ids holding any of ``cpus``, sorted, ignoring CPUs no node claims."""
        ids = {self.node_of_cpu(c) for c in cpus}
        return sorted(i for i in ids if i is not None)

    def describe(self) -> str:
        lines = []
        for n in self.nodes:
            kind = "cpu" if n.has_cpu else "memory-only"
            dist = " ".join(f"{k}:{v}" for k, v in sorted(n.distances.items()))
            lines.append(f"node{n.id} {kind:11s} cpus={format_cpulist(n.cpus) or '-'} "
                         f"mem={n.mem_bytes / 2**30:.1f} GiB dist[{dist}]")
        return "\n".join(lines)


# --- parsing -----------------------------------------------------------------------------------

def parse_cpulist(text: str, what: str = "cpulist") -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    out: set[int] = set()
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?(?::\s*(\d+)\s*/\s*(\d+)\s*)?", part)
        if not m:
            raise MixqrtError(f"{what}: cannot parse CPU list item {part!r} in {text!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or hi - lo > 1 << 16:
            raise MixqrtError(f"{what}: bad CPU range {part!r}")
        if m.group(3):  # kernel's "0-15:2/4" stride form (used group:used_size/group_size)
            used, size = int(m.group(3)), int(m.group(4))
            if size == 0:
                raise MixqrtError(f"{what}: bad CPU range {part!r}")
            out.update(c for c in range(lo, hi + 1) if (c - lo) % size < used)
        else:
            out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def format_cpulist(cpus) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8'."""
    cpus = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise MixqrtError(f"cannot read {path}: {e}") from e


def _mem_total(text: str | None, path: Path) -> int:
    if text is None:
        return 0
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", text)
    if not m:
        raise MixqrtError(f"{path}: no 'MemTotal: N kB' line")
    return int(m.group(1)) * 1024


def topology(root: str | os.PathLike | None = None) -> Topology:
    """Read the NUMA topology under ``root`` (default ``$MIXQRT_SYSFS`` or ``/sys``)."""
    root = _sysfs_root(root)
    sysdir = root / "devices" / "system"
    online_txt = _read(sysdir / "cpu" / "online")
    online = parse_cpulist(online_txt, str(sysdir / "cpu" / "online")) if online_txt is not None else None
    node_dir = sysdir / "node"
    ids = []
    if node_dir.is_dir():
        for p in node_dir.iterdir():
            m = re.fullmatch(r"node(\d+)", p.name)
            if m and p.is_dir():
                ids.append(int(m.group(1)))
    ids.sort()

    if not ids:
        if online is None:
            if str(root) != DEFAULT_ROOT:
                raise MixqrtError(f"{root}: neither devices/system/node/node* nor devices/system/cpu/online")
            online = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") \
                else tuple(range(os.cpu_count() or 1))
        mem = _proc_mem_total() if str(root) == DEFAULT_ROOT else 0
        node = Node(0, online, mem, {0: LOCAL_DISTANCE}, bool(online))
        return Topology([node], online, str(root), numa_sysfs=False)

    nodes = []
    for nid in ids:
        d = node_dir / f"node{nid}"
        cl = _read(d / "cpulist")
        cpus = parse_cpulist(cl, str(d / "cpulist")) if cl is not None else ()
        if online is not None:
            cpus = tuple(c for c in cpus if c in set(online))
        mem = _mem_total(_read(d / "meminfo"), d / "meminfo")
        dist_txt = _read(d / "distance")
        if dist_txt is not None:
            try:
                row = [int(x) for x in dist_txt.split()]
            except ValueError:
                raise MixqrtError(f"{d / 'distance'}: not a list of integers: {dist_txt!r}") from None
            if len(row) != len(ids):
                raise MixqrtError(f"{d / 'distance'}: {len(row)} distances for {len(ids)} nodes")
            distances = dict(zip(ids, row))
        else:
            distances = {i: (LOCAL_DISTANCE if i == nid else 2 * LOCAL_DISTANCE) for i in ids}
        nodes.append(Node(nid, cpus, mem, distances, bool(cpus)))
    if online is None:
        online = tuple(sorted(c for n in nodes for c in n.cpus))
    return Topology(nodes, online, str(root))


def mem_total() -> int:
    """This machine's MemTotal in bytes (0 where /proc/meminfo cannot be read)."""
    return _proc_mem_total()


def _proc_mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            return _mem_total(f.read(), Path("/proc/meminfo"))
    except (OSError, MixqrtError):
        return 0


# --- usable CPUs (affinity and cgroup quota) ---------------------------------------------------

def allowed_cpus() -> tuple[int, ...]:
    """CPUs this process may run on (sched_getaffinity; cpusets are already reflected there)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _sysfs_root(root) -> Path:
    return Path(root if root is not None else os.environ.get("MIXQRT_SYSFS", DEFAULT_ROOT))


def core_of_cpus(cpus, root: str | os.PathLike | None = None) -> dict[int, int]:
    """The physical core of each CPU, named by its lowest hardware thread: ROOT/devices/system/cpu/
    cpuN/topology/thread_siblings_list (the CPUs sharing cpuN's core, SMT siblings). A CPU whose
    list is missing or unreadable counts as a core of its own (a VM that shows no topology)."""
    base = _sysfs_root(root) / "devices" / "system" / "cpu"
    out = {}
    for c in cpus:
        p = base / f"cpu{int(c)}" / "topology" / "thread_siblings_list"
        try:
            sib = parse_cpulist(p.read_text(), str(p))
        except (OSError, MixqrtError):
            sib = ()
        out[int(c)] = min(sib) if int(c) in sib else int(c)
    return out


def core_first(cpus, root: str | os.PathLike | None = None) -> tuple[int, ...]:
    """``cpus`` ordered one hardware thread of every core before any core's second one (then the
    third, ...), each round in CPU order. Lock-step kernels on two SMT siblings share one core's load
    and FMA ports, so n workers on a machine with SMT should get n cores, not n/2 (Linux numbers
    siblings either apart, 0 and n/2, or side by side, 0 and 1, depending on the machine; this order
    is the same for both). The pool's order: platform.affinity.worker_cpus."""
    cpus = tuple(sorted(int(c) for c in cpus))
    core = core_of_cpus(cpus, root)
    rank, seen = {}, {}
    for c in cpus:
        rank[c] = seen.get(core[c], 0)
        seen[core[c]] = rank[c] + 1
    return tuple(sorted(cpus, key=lambda c: (rank[c], c)))


def cores_together(cpus, root: str | os.PathLike | None = None) -> tuple[int, ...]:
    """``cpus`` with each core's hardware threads next to each other (cores in order of their first
    CPU): contiguous runs of this order are whole cores, for splitting CPUs between processes."""
    cpus = tuple(sorted(int(c) for c in cpus))
    core = core_of_cpus(cpus, root)
    first = {}
    for c in cpus:
        first.setdefault(core[c], c)
    return tuple(sorted(cpus, key=lambda c: (first[core[c]], c)))


def physical_cores(cpus=None, root: str | os.PathLike | None = None) -> int:
    """Distinct physical cores among ``cpus`` (default: :func:`allowed_cpus`)."""
    cpus = allowed_cpus() if cpus is None else tuple(cpus)
    return len(set(core_of_cpus(cpus, root).values()))


def _cache_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text)
    if not m:
        raise ValueError(text)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def llc_bytes(root: str | os.PathLike | None = None) -> int:
    """Total last-level cache of the machine in bytes: every instance of the highest cache level
    (ROOT/devices/system/cpu/cpuN/cache/indexI/{level,size,shared_cpu_list}), each counted once;
    0 where sysfs does not say. A read-bandwidth probe over fewer bytes than this reads the cache,
    not memory (a 300 MB L3 on a 16-core Xeon VM read 250 GB/s over a 256 MB buffer)."""
    base = _sysfs_root(root) / "devices" / "system" / "cpu"
    seen, total = set(), 0
    try:
        cpu_dirs = [p for p in base.iterdir() if re.fullmatch(r"cpu\d+", p.name)]
    except OSError:
        return 0
    found = []
    for cpu in cpu_dirs:
        try:
            idx = [p for p in (cpu / "cache").iterdir() if p.name.startswith("index")]
        except OSError:
            continue
        for d in idx:
            try:
                level = int((d / "level").read_text())
                size = _cache_size((d / "size").read_text())
                shared = (d / "shared_cpu_list").read_text().strip() or cpu.name
            except (OSError, ValueError):
                continue
            found.append((level, shared, size))
    if not found:
        return 0
    best_level = max(f[0] for f in found)
    for level, shared, size in found:
        if level == best_level and shared not in seen:
            seen.add(shared)
            total += size
    return total


def cgroup_cpu_limit(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                     proc_cgroup: str | os.PathLike = "/proc/self/cgroup") -> float | None:
    """CPU bandwidth limit in CPUs (quota / period) of this process's cgroup, or None if unlimited.

    cgroup v2 reads ``cpu.max`` ("max 100000" or "150000 100000"); v1 reads ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` under the ``cpu`` controller mount. Every ancestor is checked and the
    tightest limit wins, because a parent's quota caps its children.
    """
    cgroup_root = Path(cgroup_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            bases = [cgroup_root, cgroup_root / "unified"]
            for base in bases:
                for d in _ancestors(base, rel):
                    txt = _read(d / "cpu.max")
                    if txt is None:
                        continue
                    f = txt.split()
                    if len(f) >= 1 and f[0] != "max":
                        try:
                            quota, period = int(f[0]), int(f[1]) if len(f) > 1 else 100000
                        except ValueError:
                            continue
                        if quota > 0 and period > 0:
                            limits.append(quota / period)
        elif "cpu" in controllers.split(","):
            names = [controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"]
            for name in dict.fromkeys(names):
                base = cgroup_root / name
                if not base.is_dir():
                    continue
                for d in _ancestors(base, rel):
                    q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                    if q is None or p is None:
                        continue
                    try:
                        quota, period = int(q), int(p)
                    except ValueError:
                        continue
                    if quota > 0 and period > 0:
                        limits.append(quota / period)
                break
    return min(limits) if limits else None


def _ancestors(base: Path, rel: str):
    """base/a/b/c, base/a/b, base/a, base — only those that exist."""
    parts = [p for p in rel.split("/") if p]
    for k in range(len(parts), -1, -1):
        d = base.joinpath(*parts[:k])
        if d.is_dir():
            yield d


def usable_cpus(cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                affinity=None) -> int:
    """Threads worth running: |affinity set| capped by the cgroup CPU quota (floored, at least 1).

    The quota is floored, not rounded up: lock-step matmul workers on 1.5 CPUs of quota get
    throttled mid-step, and one straggler stalls the whole step.
    """
    n = len(affinity) if affinity is not None else len(allowed_cpus())
    lim = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if lim is not None:
        n = min(n, max(1, math.floor(lim + 1e-9)))
    return max(1, n)
