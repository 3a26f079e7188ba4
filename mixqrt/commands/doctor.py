"""`mixqrt doctor`: what this machine offers and what mixqrt will use."""
from __future__ import annotations

import os
import platform

from mixqrt.platform.topology import format_cpulist


def report() -> dict:
    from mixqrt.platform import isa, tuning
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
        "switches": tuning.report(),
    }
    try:
        from mixqrt.platform.affinity import usable_cpus
        info["usable_cpus"] = usable_cpus()
    except ImportError:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    try:
        from mixqrt.platform.topology import topology
        topo = topology()
        info["numa_nodes"] = [{"id": n.id, "cpus": list(n.cpus), "mem_bytes": n.mem_bytes,
                               "has_cpu": n.has_cpu} for n in topo.nodes]
    except Exception as e:  # topology is informative only here
        topo = None
        info["numa_nodes"] = f"unavailable: {e}"
    try:
        from mixqrt.platform import affinity, topology as tp
        allowed = tp.allowed_cpus()
        info["physical_cores"] = tp.physical_cores(allowed)
        info["worker_cpus"] = affinity.worker_cpus(len(allowed), topo, allowed)
        info["llc_bytes"] = tp.llc_bytes()
    except Exception as e:  # informative only
        info["physical_cores"] = f"unavailable: {e}"
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


def model_pages(path, *, recache: bool = False) -> dict:
    """How a .mxq file's weights are mapped: the fraction in 2 MiB pages (mixqrt.io.arena
    Arena.huge_fraction) after touching every page as mixqrt.load would, and, with recache, after
    re-reading the file into 2 MiB folios (Arena.recache). Reads the whole file once (twice with
    recache)."""
    from mixqrt.errors import FormatError
    from mixqrt.io.mxq import MxqFile

    out = {"model": str(path)}
    if not os.path.isfile(path):
        raise FormatError(f"{path}: no such file (want a .mxq model file)")
    with MxqFile(path, hugepages=True) as f:
        f.arena.touch()
        out["huge_fraction"] = f.arena.huge_fraction()
        if recache:
            out["recached"] = f.arena.recache()
            f.arena.touch()
            out["huge_fraction_after"] = f.arena.huge_fraction()
    return out


def format_pages(info: dict) -> str:
    def pct(v):
        return "unknown (kernel does not say)" if v is None else f"{100 * v:.0f} %"
    lines = [f"weights    {info['model']}: {pct(info['huge_fraction'])} in 2 MiB pages"]
    if "recached" in info:
        lines.append(f"recache    {'done' if info['recached'] else 'not available'}: "
                     f"{pct(info['huge_fraction_after'])} in 2 MiB pages")
    elif info["huge_fraction"] is not None and info["huge_fraction"] < 0.5:
        lines.append("           mostly 4 KiB pages (a copied or freshly written file's page cache): "
                     "`mixqrt doctor --model FILE --recache` reads it again in 2 MiB pages (faster decode, "
                     "docs/runtime.md)")
    return "\n".join(lines)


def format_report(info: dict) -> str:
    lines = [
        f"CPU        {info['cpu_vendor']} / {info['cpu_model']}",
        f"ISA tier   {info['isa_reason']}",
        f"tiers      {', '.join(info['isa_available'])} (force one with MIXQRT_ISA=generic|avx2|avx512)",
        f"cores      {info['usable_cpus']} usable under affinity/cgroup (of {info['logical_cpus']} logical)",
    ]
    if isinstance(info.get("physical_cores"), int):
        order = info["worker_cpus"]
        lines.append(f"           {info['physical_cores']} physical cores among them; workers pinned in the order "
                     f"{', '.join(map(str, order[:8]))}{', ...' if len(order) > 8 else ''} (one per core before SMT siblings)")
    if info.get("llc_bytes"):
        lines.append(f"LLC        {info['llc_bytes'] / 2**20:.0f} MiB last-level cache (the bandwidth probe reads >= 4x that)")
    if "threads" in info:
        lines.append(f"threads    {info['threads']} kernel threads (MIXQRT_NUM_THREADS overrides)")
    nodes = info["numa_nodes"]
    if isinstance(nodes, list):
        for n in nodes:
            kind = "cpus " + format_cpulist(n["cpus"]) if n["has_cpu"] else "memory only (far/CXL tier)"
            lines.append(f"NUMA {n['id']:<5d} {kind}, {n['mem_bytes'] / 2**30:.1f} GiB")
    else:
        lines.append(f"NUMA       {nodes}")
    if "transparent_hugepages" in info:
        lines.append(f"hugepages  THP {info['transparent_hugepages']}")
    if "perf_event_paranoid" in info:
        lines.append(f"perf       perf_event_paranoid={info['perf_event_paranoid']}")
    lines.append(f"features   {' '.join(info['features'])}")
    if "switches" in info:
        from mixqrt.platform import tuning
        lines.append(tuning.format_report(info["switches"]))
    return "\n".join(lines)


