"""`mixqrt doctor`: what this machine offers and what mixqrt will use."""
from __future__ import annotations

import os
import platform


def report() -> dict:
    from mixqrt import isa
    from mixqrt._kernels import _cpu

    info = {
        "cpu_vendor": _cpu.vendor(),
        "cpu_model": _cpu.brand(),
        "isa": isa.current(),
        "isa_reason": isa.explain(),
        "isa_available": isa.available(),
        "features": sorted(_cpu.features()),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        from mixqrt.runtime.affinity import usable_cpus
        info["usable_cpus"] = usable_cpus()
    except ImportError:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    try:
        from mixqrt.runtime.topology import topology
        topo = topology()
        info["numa_nodes"] = [{"id": n.id, "cpus": list(n.cpus), "mem_bytes": n.mem_bytes,
                               "has_cpu": n.has_cpu} for n in topo.nodes]
    except Exception as e:  # topology is informative only here
        info["numa_nodes"] = f"unavailable: {e}"
    try:
        from mixqrt import ops
        info["threads"] = ops.get_num_threads()
    except (ImportError, AttributeError):
        pass
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp):
        with open(thp) as f:
            info["transparent_hugepages"] = f.read().strip()
    paranoid = "/proc/sys/kernel/perf_event_paranoid"
    if os.path.exists(paranoid):
        with open(paranoid) as f:
            info["perf_event_paranoid"] = int(f.read().strip())
    return info


def format_report(info: dict) -> str:
    lines = [
        f"CPU        {info['cpu_vendor']} / {info['cpu_model']}",
        f"ISA tier   {info['isa_reason']}",
        f"tiers      {', '.join(info['isa_available'])} (force one with MIXQRT_ISA=generic|avx2|avx512)",
        f"cores      {info['usable_cpus']} usable under affinity/cgroup (of {info['logical_cpus']} logical)",
    ]
    if "threads" in info:
        lines.append(f"threads    {info['threads']} kernel threads (MIXQRT_NUM_THREADS overrides)")
    nodes = info["numa_nodes"]
    if isinstance(nodes, list):
        for n in nodes:
            kind = "cpus " + _ranges(n["cpus"]) if n["has_cpu"] else "memory only (far/CXL tier)"
            lines.append(f"NUMA {n['id']:<5d} {kind}, {n['mem_bytes'] / 2**30:.1f} GiB")
    else:
        lines.append(f"NUMA       {nodes}")
    if "transparent_hugepages" in info:
        lines.append(f"hugepages  THP {info['transparent_hugepages']}")
    if "perf_event_paranoid" in info:
        lines.append(f"perf       perf_event_paranoid={info['perf_event_paranoid']}")
    lines.append(f"features   {' '.join(info['features'])}")
    return "\n".join(lines)


def _ranges(cpus) -> str:
    cpus = sorted(cpus)
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)
