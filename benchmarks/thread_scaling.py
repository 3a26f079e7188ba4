"""Thread scaling on one machine: the read-bandwidth probe (each pattern) and decode / prefill of a
0.5B- and a 7B-shaped 2356t model at 1..N threads, with the pool's workers pinned one per core
before any SMT sibling (platform.affinity.worker_cpus).

    python benchmarks/thread_scaling.py                       # 1, 2, 4, ... up to every usable CPU
    python benchmarks/thread_scaling.py --threads 1,2,4,8,16 --work /tmp/scaling --out docs/lab/thread-scaling.md

The models are synthetic (mixqrt.testing.synthetic, benchmarks/synthetic_mxq.py: the recipe's formats and sizes, exactly the
bytes a decode step of a real file reads, meaningless values), so the run needs no checkpoint and
fits machines that cannot reach one; `--models` also takes real .mxq paths. Where the machine has
SMT, two more rows each: 2 threads on one core's two hardware threads against 2 cores, and every
logical CPU against one thread per core. Writes the tables into --out (between markers named by
--tag, so one page holds several machines) and the raw rows to docs/data/thread-scaling-TAG.json;
`--from-json` re-renders a saved run (one made on another machine) into the page.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT, provenance, update_doc, write_json  # noqa: E402

# per model shape: (prompt tokens, decoded tokens, repeats); the 7B's prompt is short so that a
# 1-thread row takes seconds, not minutes
SHAPES = {"0.5b": (512, 128, 2), "7b": (64, 32, 1)}


def default_threads() -> list[int]:
    from mixqrt.platform import topology
    n = topology.usable_cpus()
    out, t = [], 1
    while t < n:
        out.append(t)
        t *= 2
    return out + [n]


def model_path(spec: str, work: Path, recipe: str, quiet: bool) -> tuple[str, str, tuple]:
    """(label, .mxq path, (n_prompt, n_gen, repeats)) for a shape name (synthesized once into work)
    or a real .mxq path."""
    from mixqrt.testing import synthetic as synthetic_mxq
    if spec in synthetic_mxq.CONFIGS and spec in SHAPES:
        out = work / f"mixqrt-{spec}-{recipe}.mxq"
        if out.exists():               # one of an older layout (a FormatError here) is made again
            from mixqrt.errors import FormatError
            from mixqrt.io.mxq import MxqFile
            try:
                MxqFile(out).close()
            except FormatError:
                out.unlink()
        if not out.exists():
            work.mkdir(parents=True, exist_ok=True)
            r = synthetic_mxq.write_mxq(str(out), recipe, synthetic_mxq.CONFIGS[spec], progress=not quiet)
            print(f"synthesized {out} ({r['bytes'] / 1e9:.2f} GB, {r['seconds']:.1f} s)", flush=True)
        return f"{spec} {recipe} (synthetic)", str(out), SHAPES[spec]
    if not Path(spec).exists():
        raise SystemExit(f"--models: {spec!r} is neither a shape ({', '.join(SHAPES)}) nor a file")
    return Path(spec).name, spec, SHAPES["0.5b"]


def machine_lines() -> str:
    from mixqrt.platform import affinity, topology
    cpus = topology.allowed_cpus()
    topo = topology.topology()
    order = affinity.worker_cpus(len(cpus), topo, cpus)
    return (f"- logical CPUs {len(cpus)}, physical cores {topology.physical_cores(cpus)}, NUMA nodes "
            f"{len(topo.cpu_nodes)}; worker order {', '.join(map(str, order[:8]))}"
            f"{'...' if len(cpus) > 8 else ''} (first eight, in pinning order)\n")


def run_bench(loaded, nt: int, shape: tuple, probe_bytes: int) -> dict:
    from mixqrt.commands.bench import bench
    n_prompt, n_gen, reps = shape
    return bench(loaded, threads=(nt,), n_prompt=n_prompt, n_gen=n_gen, ttft_prompt=min(128, n_prompt),
                 repeats=reps, probe_bytes=probe_bytes, probes=1, progress=False)[0]


def with_cpus(cpus, fn):
    """Run fn() with this thread's affinity set to cpus (the pool pins its workers inside it)."""
    prev = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, prev)


def scaling_table(rows) -> str:
    out = ["| model | threads | CPUs | pp tok/s | tg tok/s | tg speed-up vs 1 thread | tg per thread | "
           "GB/token | probe GB/s | tg GB/s | fraction of bound |",
           "|" + "---|" * 11]
    base = {}
    for r in rows:
        if r["threads"] == 1 and r["cpus_note"] == "":
            base[r["model"]] = r["tg_tok_s"]
    for r in rows:
        b = base.get(r["model"])
        sp = r["tg_tok_s"] / b if b else float("nan")
        out.append(f"| {r['model']} | {r['threads']} | {r['cpus_note'] or 'one per core first'} | "
                   f"{r['pp_tok_s']:.1f} | {r['tg_tok_s']:.1f} | {sp:.2f}x | {sp / r['threads']:.2f} | "
                   f"{r['decode_bytes_per_token'] / 1e9:.3f} | {r['probe_bandwidth_bytes_s'] / 1e9:.1f} | "
                   f"{r['tg_tok_s'] * r['decode_bytes_per_token'] / 1e9:.1f} | {r['bandwidth_ratio']:.2f} |")
    return "\n".join(out)


def probe_table(probes: dict[int, dict[str, float]]) -> str:
    names = []
    for d in probes.values():
        for k in d:
            if k not in names:
                names.append(k)
    out = ["| threads | best GB/s | best pattern | " + " | ".join(names) + " |", "|" + "---|" * (3 + len(names))]
    for nt, d in probes.items():
        best = max(d, key=d.get)
        out.append(f"| {nt} | {d[best] / 1e9:.1f} | {best} | " +
                   " | ".join(f"{d[k] / 1e9:.1f}" if d.get(k, -1) > 0 else "-" for k in names) + " |")
    return "\n".join(out)


KERNEL_CASES = [("q3x", 4864, 896), ("q4x", 4864, 896), ("q6x", 4864, 896), ("q3x", 18944, 3584)]


def kernel_rates(threads) -> list[dict]:
    """Matvec rate (packed bytes / median time) of the 2356t formats, repeated on one matrix: the
    0.5B FFN shape stays in L2/L3, so this is the cores' compute rate, not memory's; the 7B shape
    (30 MB) misses a 32 MB L3 but not a 300 MB one. Timed with the pool as a lone product finds it
    and in hot mode (ops.hot: workers spin between products, as in a model's decode step)."""
    import numpy as np
    from kernels import packed, timeit

    from mixqrt import ops
    rng = np.random.default_rng(0)
    out = []
    for fmt, n, k in KERNEL_CASES:
        w = packed(fmt, n, k, rng)
        x = rng.standard_normal(k).astype(np.float32)
        for nt in threads:
            ops.set_num_threads(nt)
            med, best = timeit(lambda: ops.matmul(w, x), 0.2)
            with ops.hot():            # workers spin between products, as in a model's decode step
                med_hot, _ = timeit(lambda: ops.matmul(w, x), 0.2)
            out.append({"fmt": fmt, "n": n, "k": k, "threads": nt, "median_s": med, "median_hot_s": med_hot,
                        "bytes": int(w.raw.size), "gb_s": w.raw.size / med / 1e9})
    ops.set_num_threads(1)
    return out


def kernel_table(rates) -> str:
    out = ["| format | shape | packed MB | threads | median us | GB/s | median us, hot pool |", "|" + "---|" * 7]
    for r in rates:
        hot = f"{r['median_hot_s'] * 1e6:.0f}" if r.get("median_hot_s") else "-"
        out.append(f"| {r['fmt']} | {r['n']} x {r['k']} | {r['bytes'] / 1e6:.1f} | {r['threads']} | "
                   f"{r['median_s'] * 1e6:.0f} | {r['gb_s']:.1f} | {hot} |")
    return "\n".join(out)


def blocks_for(tag: str, run: dict) -> dict[str, str]:
    """The docs/ blocks of one machine's run (named by tag, so one page holds several machines)."""
    probes = {int(k): v for k, v in run.get("probes", {}).items()}
    return {f"thread-scaling-{tag}-machine": run["machine"],
            f"thread-scaling-{tag}-probe": probe_table(probes) if probes else "",
            f"thread-scaling-{tag}-decode": scaling_table(run["rows"]) if run.get("rows") else "",
            f"thread-scaling-{tag}-kernels": kernel_table(run["kernels"]) if run.get("kernels") else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default=None, help="comma list (default: 1, 2, 4, ... and every usable CPU)")
    ap.add_argument("--models", default="0.5b,7b", help="comma list of shape names (0.5b, 7b) or .mxq paths")
    ap.add_argument("--recipe", default="2356t")
    ap.add_argument("--work", default="/tmp/mixqrt-scaling", help="where synthetic models are written")
    ap.add_argument("--probe-bytes", type=int, default=1 << 30,
                    help="probe buffer (at least 4x the last-level cache in any case)")
    ap.add_argument("--tag", default="local", help="names this machine's tables in --out (one page, several machines)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "lab" / "thread-scaling.md"))
    ap.add_argument("--json", default=None, help="raw rows (default docs/data/thread-scaling-TAG.json)")
    ap.add_argument("--from-json", default=None, help="only write --out's TAG tables from this saved run")
    ap.add_argument("--kernel-threads", default="1,2", help="thread counts of the matvec rate table ('' skips it)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    if a.from_json:
        import json
        update_doc(a.out, blocks_for(a.tag, json.loads(Path(a.from_json).read_text())), title="Thread scaling")
        return 0
    json_path = a.json or str(ROOT / "docs" / "data" / f"thread-scaling-{a.tag}.json")
    from mixqrt import load, ops
    from mixqrt.platform import topology
    threads = [int(t) for t in a.threads.split(",")] if a.threads else default_threads()
    command = "python benchmarks/thread_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = provenance(command.strip()) + machine_lines()
    probes: dict[int, dict[str, float]] = {}
    rows: list[dict] = []
    rates: list[dict] = []

    def flush():
        run = {"machine": head, "probes": probes, "rows": rows, "kernels": rates}
        update_doc(a.out, blocks_for(a.tag, run), title="Thread scaling")
        write_json(json_path, run)

    for nt in threads:
        t0 = time.perf_counter()
        probes[nt] = ops.read_bandwidth_patterns(a.probe_bytes, nt, 3)
        print(f"probe {nt} threads: best {max(probes[nt].values()) / 1e9:.1f} GB/s "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if a.kernel_threads:
        rates.extend(kernel_rates([int(t) for t in a.kernel_threads.split(",")]))
        print(kernel_table(rates), flush=True)
    flush()
    cpus = topology.allowed_cpus()
    core = topology.core_of_cpus(cpus)
    by_core: dict[int, list[int]] = {}
    for c in cpus:
        by_core.setdefault(core[c], []).append(c)
    smt_pair = next((v[:2] for v in by_core.values() if len(v) >= 2), None)
    cores = topology.physical_cores(cpus)
    for spec in a.models.split(","):
        label, path, shape = model_path(spec.strip(), Path(a.work), a.recipe, a.quiet)
        loaded = load(path, progress=not a.quiet)
        for nt in threads:
            t0 = time.perf_counter()
            r = run_bench(loaded, nt, shape, a.probe_bytes)
            r.update(model=label, cpus_note="")
            rows.append(r)
            print(f"{label} {nt} threads: pp {r['pp_tok_s']:.1f} tg {r['tg_tok_s']:.1f} tok/s, "
                  f"{r['bandwidth_ratio']:.2f} of {r['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            flush()
        if smt_pair is not None:       # SMT: is a second hardware thread worth a core's share?
            r = with_cpus(smt_pair, lambda: run_bench(loaded, 2, shape, a.probe_bytes))
            r.update(model=label, cpus_note=f"one core's 2 SMT threads ({topology.format_cpulist(smt_pair)})")
            rows.append(r)
            if cores != len(cpus) and cores not in threads:
                r = run_bench(loaded, cores, shape, a.probe_bytes)
                r.update(model=label, cpus_note="one per physical core")
                rows.append(r)
            flush()
        ops.set_num_threads(1)
        loaded = None          # unmap before the next model
    print(probe_table(probes))
    print(scaling_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
