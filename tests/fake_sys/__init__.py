"""Fake sysfs trees for topology/placement tests.

Checked-in trees (also usable by hand: ``MIXQRT_SYSFS=tests/fake_sys/two_node mixqrt inspect --placement``):
  one_node        node0: cpus 0-1, 8 GiB
  two_node        node0: cpus 0-3, node1: cpus 4-7, 16 GiB each, distance 21
  cxl             node0: cpus 0-3, 32 GiB; node1: no CPUs, 64 GiB (CXL expander), distance 20
  two_node_cxl    nodes 0,1 with CPUs; nodes 2,3 CPU-less, 2 nearer to node0, 3 nearer to node1
``make_sys`` builds the same kind of tree anywhere (tmp_path), ``regenerate()`` rewrites the above.
"""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB_KB = 1 << 20  # kB per GiB

LAYOUTS = {
    "one_node": dict(online="0-1", nodes=[("0-1", 8 * GiB_KB, [10])]),
    "two_node": dict(online="0-7", nodes=[("0-3", 16 * GiB_KB, [10, 21]),
                                          ("4-7", 16 * GiB_KB, [21, 10])]),
    "cxl": dict(online="0-3", nodes=[("0-3", 32 * GiB_KB, [10, 20]),
                                     ("", 64 * GiB_KB, [20, 10])]),
    "two_node_cxl": dict(online="0-7", nodes=[("0-3", 16 * GiB_KB, [10, 21, 14, 24]),
                                              ("4-7", 16 * GiB_KB, [21, 10, 24, 14]),
                                              ("", 64 * GiB_KB, [14, 24, 10, 26]),
                                              ("", 64 * GiB_KB, [24, 14, 26, 10])]),
}


def make_sys(root, nodes, online=None, node_ids=None) -> Path:
    """Write ROOT/devices/system/{cpu/online,node/nodeN/{cpulist,distance,meminfo}}.

    ``nodes``: list of (cpulist, mem_kb, distances or None); a field that is None is not written.
    """
    root = Path(root)
    sysdir = root / "devices" / "system"
    (sysdir / "cpu").mkdir(parents=True, exist_ok=True)
    if online is not None:
        (sysdir / "cpu" / "online").write_text(online + "\n")
    ids = node_ids or list(range(len(nodes)))
    for nid, (cpulist, mem_kb, dist) in zip(ids, nodes):
        d = sysdir / "node" / f"node{nid}"
        d.mkdir(parents=True, exist_ok=True)
        if cpulist is not None:
            (d / "cpulist").write_text(cpulist + "\n")
        if mem_kb is not None:
            free = mem_kb // 2
            (d / "meminfo").write_text(
                f"Node {nid} MemTotal:       {mem_kb} kB\n"
                f"Node {nid} MemFree:        {free} kB\n"
                f"Node {nid} MemUsed:        {mem_kb - free} kB\n")
        if dist is not None:
            (d / "distance").write_text(" ".join(map(str, dist)) + "\n")
    return root


def tree(name: str) -> Path:
    return HERE / name


def regenerate():
    for name, spec in LAYOUTS.items():
        make_sys(HERE / name, spec["nodes"], spec["online"])


if __name__ == "__main__":
    regenerate()
