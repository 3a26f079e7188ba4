"""Topology from fake sysfs trees (2-node, 1-node + CXL), CPU-list parsing, usable CPU count."""
import os

import pytest

from fake_sys import make_sys, tree
from mixqrt.errors import MixqrtError
from mixqrt.platform import affinity
from mixqrt.platform.topology import (cgroup_cpu_limit, format_cpulist, parse_cpulist, topology,
                                     usable_cpus)


@pytest.mark.parametrize("text,want", [
    ("", ()), ("\n", ()), ("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,4,6-7\n", (0, 1, 4, 6, 7)),
    ("3,1,2", (1, 2, 3)), ("0-7:2/4", (0, 1, 4, 5)),
])
def test_parse_cpulist(text, want):
    assert parse_cpulist(text) == want
    if want:
        assert parse_cpulist(format_cpulist(want)) == want


@pytest.mark.parametrize("bad", ["a", "1-", "3-1", "0,,1", "-2"])
def test_parse_cpulist_rejects(bad):
    with pytest.raises(MixqrtError):
        parse_cpulist(bad)


def test_two_node():
    t = topology(tree("two_node"))
    assert t.is_numa and [n.id for n in t.nodes] == [0, 1]
    assert t.node(0).cpus == (0, 1, 2, 3) and t.node(1).cpus == (4, 5, 6, 7)
    assert all(n.has_cpu for n in t.nodes) and t.memory_only_nodes == []
    assert t.node(1).mem_bytes == 16 << 30
    assert t.distance(0, 1) == 21 and t.distance(1, 1) == 10
    assert t.node_of_cpu(5) == 1 and t.node_of_cpu(99) is None
    assert t.nodes_of_cpus([0, 6]) == [0, 1]
    assert t.online_cpus == tuple(range(8))


def test_cxl_node_is_memory_only():
    t = topology(tree("cxl"))
    assert [n.id for n in t.cpu_nodes] == [0]
    far = t.memory_only_nodes
    assert [n.id for n in far] == [1] and far[0].cpus == () and not far[0].has_cpu
    assert far[0].mem_bytes == 64 << 30 and t.distance(0, 1) == 20
    assert "memory-only" in t.describe()


def test_env_root(monkeypatch):
    monkeypatch.setenv("MIXQRT_SYSFS", str(tree("cxl")))
    assert len(topology().nodes) == 2


def test_offline_cpus_dropped(tmp_path):
    make_sys(tmp_path, [("0-3", 1024, [10, 20]), ("4-7", 1024, [20, 10])], online="0-2,4")
    t = topology(tmp_path)
    assert t.node(0).cpus == (0, 1, 2) and t.node(1).cpus == (4,)


def test_sparse_node_ids_and_missing_files(tmp_path):
    # nodes 0 and 2 (a hot-removed node 1), node2 without meminfo or distance
    make_sys(tmp_path, [("0-1", 2048, [10, 30]), ("", None, None)], online="0-1", node_ids=[0, 2])
    t = topology(tmp_path)
    assert [n.id for n in t.nodes] == [0, 2]
    assert t.node(0).distances == {0: 10, 2: 30}
    assert t.node(2).mem_bytes == 0 and t.memory_only_nodes == []  # no memory: not a tier
    assert t.distance(2, 2) == 10


def test_no_node_dir_is_one_node(tmp_path):
    (tmp_path / "devices/system/cpu").mkdir(parents=True)
    (tmp_path / "devices/system/cpu/online").write_text("0-5\n")
    t = topology(tmp_path)
    assert not t.is_numa and not t.numa_sysfs and t.nodes[0].cpus == tuple(range(6))


@pytest.mark.parametrize("fname,text", [("distance", "10 x"), ("distance", "10"), ("meminfo", "junk")])
def test_malformed_tree_is_reported(tmp_path, fname, text):
    make_sys(tmp_path, [("0-1", 1024, [10, 20]), ("2-3", 1024, [20, 10])], online="0-3")
    (tmp_path / "devices/system/node/node1" / fname).write_text(text)
    with pytest.raises(MixqrtError, match=fname):
        topology(tmp_path)


def test_empty_root_is_reported(tmp_path):
    with pytest.raises(MixqrtError):
        topology(tmp_path)


def test_real_machine_reads():
    t = topology("/sys")
    assert t.nodes and t.cpu_nodes
    allowed = set(os.sched_getaffinity(0))
    assert allowed & set(t.online_cpus)


# --- usable CPUs: affinity capped by cgroup quota ---

def _cg(tmp_path, proc, files):
    (tmp_path / "proc").write_text(proc)
    for rel, text in files.items():
        p = tmp_path / "cg" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "cg", tmp_path / "proc"


def test_cgroup_v2_quota(tmp_path):
    root, proc = _cg(tmp_path, "0::/user.slice/job\n", {
        "cpu.max": "max 100000\n",
        "user.slice/cpu.max": "250000 100000\n",
        "user.slice/job/cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) == 2.5
    assert usable_cpus(root, proc, affinity=range(8)) == 2
    assert usable_cpus(root, proc, affinity=[0]) == 1


def test_cgroup_v2_unlimited_and_tiny(tmp_path):
    root, proc = _cg(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_limit(root, proc) is None
    assert usable_cpus(root, proc, affinity=range(6)) == 6
    (root / "cpu.max").write_text("20000 100000\n")  # 0.2 CPU still runs one thread
    assert usable_cpus(root, proc, affinity=range(6)) == 1


def test_cgroup_v1_quota(tmp_path):
    root, proc = _cg(tmp_path, "12:memory:/x\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_limit(root, proc) == 3.0
    assert usable_cpus(root, proc, affinity=range(16)) == 3


def test_usable_cpus_here():
    n = usable_cpus()
    assert 1 <= n <= len(os.sched_getaffinity(0))


# --- pinning ---

def test_pin_current_thread_is_per_thread():
    import threading
    allowed = sorted(os.sched_getaffinity(0))
    seen = {}

    def worker():
        prev = affinity.pin_current_thread([allowed[-1]])
        seen["prev"], seen["now"] = prev, os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["now"] == {allowed[-1]} and set(seen["prev"]) == set(allowed)
    assert sorted(os.sched_getaffinity(0)) == allowed  # the main thread is untouched


def test_pinned_restores():
    allowed = os.sched_getaffinity(0)
    with affinity.pinned([min(allowed)]):
        assert os.sched_getaffinity(0) == {min(allowed)}
    assert os.sched_getaffinity(0) == allowed


def test_pin_errors():
    with pytest.raises(MixqrtError):
        affinity.pin_current_thread([])
    with pytest.raises(MixqrtError, match="cannot pin"):
        affinity.pin_current_thread([100000])


def test_worker_cpus_compact():
    t = topology(tree("two_node"))
    assert affinity.worker_cpus(3, t, allowed=range(8)) == [0, 1, 2]
    assert affinity.worker_cpus(3, t, allowed=[1, 4, 5, 6]) == [4, 5, 6]  # node1 has more
    assert affinity.worker_cpus(2, None, allowed=[3, 1]) == [1, 3]


def _smt_tree(root, siblings):
    for group in siblings:
        for c in group:
            d = root / "devices" / "system" / "cpu" / f"cpu{c}" / "topology"
            d.mkdir(parents=True)
            (d / "thread_siblings_list").write_text(",".join(map(str, group)) + "\n")
    return root


@pytest.mark.parametrize("siblings,want", [
    # Linux numbers SMT siblings apart (Intel servers: 0 and 4) or side by side (many VMs, some AMD)
    ([(0, 4), (1, 5), (2, 6), (3, 7)], (0, 1, 2, 3, 4, 5, 6, 7)),
    ([(0, 1), (2, 3), (4, 5), (6, 7)], (0, 2, 4, 6, 1, 3, 5, 7)),
    ([(0,), (1,), (2,), (3,)], (0, 1, 2, 3)),                       # no SMT
    ([(0, 1, 2, 3)], (0, 1, 2, 3)),                                 # 4-way SMT, one core
])
def test_worker_cpus_one_per_core_first(tmp_path, siblings, want):
    from mixqrt.platform.topology import core_first, cores_together, physical_cores
    root = _smt_tree(tmp_path, siblings)
    cpus = sorted(c for g in siblings for c in g)
    assert core_first(cpus, root) == want
    assert affinity.worker_cpus(len(cpus), None, cpus, sysfs_root=root) == list(want)
    assert physical_cores(cpus, root) == len(siblings)
    # contiguous runs of the splitting order are whole cores
    together = cores_together(cpus, root)
    k = len(siblings[0])
    assert [tuple(sorted(together[i:i + k])) for i in range(0, len(together), k)] == [tuple(sorted(g)) for g in siblings]
    # an affinity subset keeps the rule: 2 workers on a 2-core, 4-thread subset get both cores
    if len(siblings) >= 2 and len(siblings[0]) == 2:
        sub = sorted(siblings[0] + siblings[1])
        assert set(affinity.worker_cpus(2, None, sub, sysfs_root=root)) == {siblings[0][0], siblings[1][0]}


def test_worker_cpus_without_topology_files(tmp_path):
    """A VM that shows no cpuN/topology (or garbage in it): every CPU its own core, CPU order."""
    from mixqrt.platform.topology import core_first, physical_cores
    d = tmp_path / "devices" / "system" / "cpu" / "cpu1" / "topology"
    d.mkdir(parents=True)
    (d / "thread_siblings_list").write_text("garbage\n")
    assert core_first([3, 1, 0, 2], tmp_path) == (0, 1, 2, 3)
    assert physical_cores([0, 1, 2, 3], tmp_path) == 4


def test_pool_and_probe_pin_in_worker_order(monkeypatch):
    """ops.set_num_threads and the bandwidth probe take the CPU order from affinity.worker_cpus."""
    from mixqrt import ops
    if ops._ops is None:
        pytest.skip("kernels not built")
    n = ops.get_num_threads()
    seen = []
    real = affinity.worker_cpus
    monkeypatch.setattr(affinity, "worker_cpus", lambda *a, **k: seen.append(1) or real(*a, **k))
    try:
        ops.set_num_threads(2 if n == 1 else 1)       # another size: the pool restarts and re-pins
        assert ops.read_bandwidth(1 << 22, 1, 1) > 0
        assert len(seen) == 2
    finally:
        ops.set_num_threads(n)


def _cache(root, cpu, index, level, size, shared):
    d = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "size").write_text(f"{size}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_llc_bytes_counts_each_instance_once(tmp_path):
    """Two L3 instances (two CCXs) of 32 MiB, seen from 4 CPUs: 64 MiB; L2s are not the LLC."""
    from mixqrt.platform.topology import llc_bytes
    for cpu in range(4):
        _cache(tmp_path, cpu, 2, 2, "1024K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "32768K", "0-1" if cpu < 2 else "2-3")
    assert llc_bytes(tmp_path) == 64 << 20


def test_llc_bytes_unknown_is_zero(tmp_path):
    from mixqrt.platform.topology import llc_bytes
    assert llc_bytes(tmp_path) == 0
    _cache(tmp_path, 0, 3, 3, "lots", "0")            # unparsable size: skipped, not a crash
    assert llc_bytes(tmp_path) == 0
    _cache(tmp_path, 1, 3, 3, "300M", "1")
    assert llc_bytes(tmp_path) == 300 << 20


def test_probe_reads_past_the_llc(monkeypatch):
    """The bandwidth probe's buffer is at least 4x the LLC, whatever a caller asks for: a smaller
    one measures the cache (a 300 MB L3 read 250 GB/s over a 256 MB buffer)."""
    from mixqrt import ops
    from mixqrt.platform import topology as topo
    monkeypatch.setattr(topo, "llc_bytes", lambda root=None: 300 << 20)
    assert ops.probe_bytes(256 << 20) == 1200 << 20
    assert ops.probe_bytes(2 << 30) == 2 << 30


def test_numa_compact_then_core_first(tmp_path):
    """Two nodes, SMT siblings side by side: the pool fills node 0's cores, then their siblings, then
    node 1; splitting the machine keeps each core's two threads in one set."""
    make_sys(tmp_path, [("0-3", 1024, [10, 20]), ("4-7", 1024, [20, 10])])
    _smt_tree(tmp_path, [(0, 1), (2, 3), (4, 5), (6, 7)])
    t = topology(tmp_path)
    assert affinity.worker_cpus(8, t, allowed=range(8)) == [0, 2, 1, 3, 4, 6, 5, 7]
    assert affinity.worker_cpus(2, t, allowed=range(8)) == [0, 2]
    assert affinity.compact_cpus(t, allowed=range(8)) == list(range(8))


@pytest.mark.parametrize("siblings", [[(0, 4), (1, 5), (2, 6), (3, 7)], [(0, 1), (2, 3), (4, 5), (6, 7)]])
def test_replica_core_sets_are_whole_cores(tmp_path, siblings):
    from mixqrt.serving.server.ray import core_sets
    make_sys(tmp_path, [("0-7", 1024, [10])])
    _smt_tree(tmp_path, siblings)
    sets = core_sets(4, topology(tmp_path), allowed=range(8))
    assert sorted(sets) == sorted(tuple(sorted(g)) for g in siblings)
