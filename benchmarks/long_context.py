"""Long prompts: mixqrt's `bench --depth` and llama.cpp's `llama-bench -d` side by side, same weights,
same machine, same threads, at depths 0, 4096, 16384 and 32768 (issue 41).

At depth N the KV cache first holds N tokens of context (filled, not timed); then a prompt of
--n-prompt tokens is timed (pp) and --n-gen greedy decode steps (tg), both attending over the depth.
mixqrt runs its default .mxq of the test model with each --kv-types; llama.cpp runs its Q4_0 and
Q3_K_M (llama-quantize from an F16 conversion of the same test GGUF) with -fa 0/1 and f16 / q8_0
K and V caches (V quantized needs -fa 1); the table takes llama.cpp's best per depth.

    python benchmarks/long_context.py --lock /work/bench.lock            # measure what is missing, report
    python benchmarks/long_context.py --report-only                      # rebuild the page from the raw files
    python benchmarks/long_context.py --depths 0,4096 --kv-types f32,q4 --lcpp-types Q4_0

Every measurement is one child process (mixqrt bench --json, or llama-bench -o jsonl) whose raw
output is kept in docs/data/long_context/ with the load average before and after it; a measurement
whose file exists is not run again (--fresh runs it again). With --lock FILE each child holds that
flock while it runs, so other benchmarks on a shared machine take turns with it. Writes the tables
and the plot into docs/long-context.md (between its mixqrt:long-context-* markers) and
docs/long-context.png.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, llama_cpp_bin, machine_info, provenance, update_doc  # noqa: E402

DATA = ROOT / "docs" / "data" / "long_context"
DOC = ROOT / "docs" / "long-context.md"
PLOT = ROOT / "docs" / "long-context.png"
LCPP_CACHES = ("f16", "q8_0")


SRC = {"dir": str(ROOT)}     # the mixqrt source tree the children run (--src; default this one)


def child_env() -> dict:
    """The children's environment: they import mixqrt from SRC (they also run with cwd=SRC)."""
    return {**os.environ, "PYTHONPATH": SRC["dir"]}


def code_commit() -> str:
    """The commit of the mixqrt source the children import (--src), '+dirty' when its work tree has
    changes."""
    src = SRC["dir"]
    try:
        head = subprocess.run(["git", "-C", src, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Lock:
    """flock on a file while a child runs (None: no lock)."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        if self.path:
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.path:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()
        return False


# ----------------------------------------------------------------------------------- the GGUFs
def prepare_ggufs(src: Path, folder: Path, types) -> dict:
    """llama.cpp's files: F16 from the test GGUF (llama-quantize --allow-requantize), then each type
    from that F16, as benchmarks/fim_exact.py and docs/results.md made theirs. Reused when present."""
    folder.mkdir(parents=True, exist_ok=True)
    q = str(llama_cpp_bin("llama-quantize"))
    f16 = folder / "qwen-F16.gguf"
    out = {}
    for t in types:
        p = folder / f"qwen-{t}.gguf"
        if not p.exists():
            if not f16.exists():
                _run([q, "--allow-requantize", str(src), str(f16) + ".part", "F16", "2"])
                os.replace(str(f16) + ".part", f16)
            _run([q, str(f16), str(p) + ".part", t, "2"])
            os.replace(str(p) + ".part", p)
        out[t] = p
    return out


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


# ----------------------------------------------------------------------------------- measurements
def measured(path: Path) -> bool:
    """A raw file that holds a result (a failed run's record is measured again)."""
    if not path.exists():
        return False
    if path.suffix == ".jsonl":
        return path.stat().st_size > 0
    try:
        return "result" in json.loads(path.read_text())
    except ValueError:
        return False

def mixqrt_file(kv: str, depth: int, pp: int | None = None) -> Path:
    return DATA / (f"mixqrt-{kv}-d{depth}.json" if pp is None else f"mixqrt-{kv}-pp{pp}.json")


def lcpp_file(t: str, fa: int, cache: str, depth: int, pp: int | None = None) -> Path:
    return DATA / (f"llamacpp-{t}-fa{fa}-{cache}-d{depth}.jsonl" if pp is None else
                   f"llamacpp-{t}-fa{fa}-{cache}-pp{pp}.jsonl")


def run_mixqrt(mxq: str, kv: str, depth: int, a, lock, pp: int | None = None) -> None:
    """One `mixqrt bench` child: at `depth`, or (pp) one long prompt of pp tokens at depth 0."""
    out = mixqrt_file(kv, depth, pp)
    cmd = [sys.executable, "-m", "mixqrt", "bench", mxq, "-t", str(a.threads), "--depth", str(depth),
           "--kv-type", kv, "-p", str(pp or a.n_prompt), "-n", str(4 if pp else a.n_gen), "-r", str(a.repetitions),
           "--json", "-q"]
    with lock:
        before, t = loadavg(), time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=SRC["dir"], env=child_env())
        after = loadavg()
    rec = {"command": shlex.join(["mixqrt"] + cmd[3:]), "loadavg_before": before, "loadavg_after": after,
           "seconds": round(time.time() - t, 1), "returncode": r.returncode, "code": code_commit()}
    if r.returncode == 0:
        rec["result"] = json.loads(r.stdout.strip().splitlines()[-1])
    else:
        rec["error"] = r.stderr[-3000:]
    DATA.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{out.name}: {'ok' if r.returncode == 0 else 'FAILED'} (load {before} -> {after})", file=sys.stderr)


def run_lcpp(gguf: Path, t: str, fa: int, cache: str, depth: int, a, lock, pp: int | None = None) -> None:
    out = lcpp_file(t, fa, cache, depth, pp)
    cmd = [str(llama_cpp_bin("llama-bench")), "-m", str(gguf), "-t", str(a.threads), "-fa", str(fa), "-ctk", cache,
           "-ctv", cache, "-d", str(depth), "-p", str(pp or a.n_prompt), "-n", str(0 if pp else a.n_gen),
           "-r", str(a.repetitions), "-o", "jsonl"]
    with lock:
        before = loadavg()
        r = subprocess.run(cmd, capture_output=True, text=True)
        after = loadavg()
    DATA.mkdir(parents=True, exist_ok=True)
    (out.with_suffix(".err")).write_text(f"# {shlex.join(cmd)}\n# load {before} -> {after}\n" + r.stderr[-20000:])
    if r.returncode == 0:
        out.write_text(r.stdout)
    print(f"{out.name}: {'ok' if r.returncode == 0 else 'FAILED'} (load {before} -> {after})", file=sys.stderr)


# ----------------------------------------------------------------------------------- reading back
def read_mixqrt() -> dict:
    """(kv_type, depth) -> the bench row (with load averages)."""
    res = {}
    for p in sorted(DATA.glob("mixqrt-*-d*.json")):
        rec = json.loads(p.read_text())
        if "result" in rec and rec["result"].get("n_prompt") == _N_PROMPT.get("n", rec["result"].get("n_prompt")):
            row = dict(rec["result"])
            row["load"] = f"{rec['loadavg_before'].split()[0]}/{rec['loadavg_after'].split()[0]}"
            res[(row["kv_type"], int(row["depth"]))] = row
    return res


_N_PROMPT: dict = {}      # the depth table's prompt length (set by main): long-prompt runs stay out of it


def read_long_prompts() -> tuple[dict, dict]:
    """The --pp-long runs: mixqrt (kv_type, tokens) -> bench row; llama.cpp (type, fa, cache, tokens) -> tok/s."""
    mx, lc = {}, {}
    for p in sorted(DATA.glob("mixqrt-*-pp*.json")):
        rec = json.loads(p.read_text())
        if "result" in rec:
            r = dict(rec["result"])
            r["load"] = f"{rec['loadavg_before'].split()[0]}/{rec['loadavg_after'].split()[0]}"
            mx[(r["kv_type"], int(r["n_prompt"]))] = r
    for p in sorted(DATA.glob("llamacpp-*-pp*.jsonl")):
        t, fa, cache = p.stem.split("-")[1], int(p.stem.split("-")[2][2:]), p.stem.split("-")[3]
        for line in p.read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                if r.get("n_gen", 0) == 0:
                    lc[(t, fa, cache, int(r["n_prompt"]))] = {"pp": float(r["avg_ts"]), "load": _lcpp_load(p)}
    return mx, lc


def report_long_prompts(a) -> str:
    mx, lc = read_long_prompts()
    if not mx and not lc:
        return "(not measured yet: --pp-long N)"
    rows = ["| prompt tokens | mixqrt KV | mixqrt pp tok/s | llama.cpp best pp tok/s | ratio | peak RSS MiB | "
            "file + KV + 200 MiB | RSS / that | load |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for (kv, n), r in sorted(mx.items(), key=lambda x: (x[0][1], x[0][0])):
        best = max(((v["pp"], f"{k[0]} fa{k[1]} {k[2]}") for k, v in lc.items() if k[3] == n), default=None)
        bound = (r.get("file_bytes") or r["model_bytes"]) + n * r["kv_bytes_per_token"] + (200 << 20)
        rows.append(f"| {n:,d} | {kv} | {r['pp_tok_s']:.1f} | " + (f"{best[0]:.1f} ({best[1]}) | {r['pp_tok_s'] / best[0]:.2f}x"
                    if best else "- | -") + f" | {r['peak_rss_bytes'] / 2**20:,.0f} | {bound / 2**20:,.0f} | "
                    f"{r['peak_rss_bytes'] / bound:.2f} | {r['load']} |")
    for k, v in sorted(lc.items()):
        rows.append(f"| {k[3]:,d} | llama.cpp {k[0]} fa{k[1]} {k[2]} | - | {v['pp']:.1f} | - | - | - | - | {v['load']} |")
    return "\n".join(rows)


def read_lcpp() -> dict:
    """(type, fa, cache, depth) -> {"pp": tok/s, "tg": tok/s}, from every llama-bench jsonl kept
    (one file may hold several depths), with the load averages its .err file recorded."""
    res: dict = {}
    for p in sorted(DATA.glob("llamacpp-*-d*.jsonl")):
        t = p.stem.split("-")[1]
        load = _lcpp_load(p)
        for line in p.read_text().splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            fa = int(r.get("flash_attn") in (True, 1, "1", "on", "enabled"))
            key = (t, fa, r.get("type_k"), int(r.get("n_depth", 0)))
            d = res.setdefault(key, {"load": load})
            if r.get("n_gen", 0) == 0 and r.get("n_prompt", 0) > 0:
                d["pp"] = float(r["avg_ts"])
                d["n_prompt"] = int(r["n_prompt"])
            elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
                d["tg"] = float(r["avg_ts"])
                d["n_gen"] = int(r["n_gen"])
    return res


def _lcpp_load(p: Path) -> str:
    """The load average before/after a llama-bench run: the .err file's header (this script) or
    the shell runner's log (llamacpp-runs.log: 'lock ... load: a b c' and 'end ... load: a b c')."""
    err = p.with_suffix(".err")
    if err.exists():
        for line in err.read_text().splitlines()[:3]:
            if line.startswith("# load "):
                b, _, a = line[7:].partition(" -> ")
                return f"{b.split()[0]}/{a.split()[0]}"
    log = DATA / "llamacpp-runs.log"
    if log.exists():
        parts = p.stem.split("-")           # llamacpp-TYPE-faN-CACHE-dDEPTHS
        tag = f"{parts[1]} {parts[2]} {parts[3]} d{parts[4][1:].replace('_', ',')}"
        lock = end = None
        for line in log.read_text().splitlines():
            if f" {tag} " in line + " " and "load:" in line:
                v = line.split("load:")[1].split()[0]
                if " lock " in line:
                    lock = v
                elif " end " in line:
                    end = v
        if lock or end:
            return f"{lock or '?'}/{end or '?'}"
    return "?"


# ----------------------------------------------------------------------------------- report
def best_lcpp(lc: dict, depth: int, what: str):
    """llama.cpp's best `what` ('pp' / 'tg') at a depth over types, -fa and caches -> (value, label)."""
    best = None
    for (t, fa, cache, d), v in lc.items():
        if d == depth and what in v and (best is None or v[what] > best[0]):
            best = (v[what], f"{t} fa{fa} {cache}", v.get("load", "?"))
    return best


def report(a) -> None:
    mx, lc = read_mixqrt(), read_lcpp()
    depths = sorted({d for _, d in mx} | {k[3] for k in lc})
    kvs = [k for k in a.kv_types.split(",") if any(kv == k for kv, _ in mx)] or sorted({kv for kv, _ in mx})
    head = ("| depth | mixqrt KV | mixqrt pp tok/s | mixqrt tg tok/s | tg vs own depth 0 | llama.cpp best pp tok/s "
            "| llama.cpp best tg tok/s | pp ratio | tg ratio | load (mixqrt; llama.cpp) |")
    rows = [head, "|" + "---:|" * 10]
    for d in depths:
        bp, bt = best_lcpp(lc, d, "pp"), best_lcpp(lc, d, "tg")
        for kv in kvs or [None]:
            r = mx.get((kv, d))
            r0 = mx.get((kv, 0))
            pp = f"{r['pp_tok_s']:.1f}" if r else "-"
            tg = f"{r['tg_tok_s']:.1f}" if r else "-"
            own = f"{r['tg_tok_s'] / r0['tg_tok_s']:.2f}x" if r and r0 else "-"
            lpp = f"{bp[0]:.1f} ({bp[1]})" if bp else "-"
            ltg = f"{bt[0]:.1f} ({bt[1]})" if bt else "-"
            rp = f"{r['pp_tok_s'] / bp[0]:.2f}x" if r and bp else "-"
            rt = f"{r['tg_tok_s'] / bt[0]:.2f}x" if r and bt else "-"
            load = f"{r['load'] if r else '-'}; {bt[2] if bt else '-'}"
            rows.append(f"| {d:,d} | {kv or '-'} | {pp} | {tg} | {own} | {lpp} | {ltg} | {rp} | {rt} | {load} |")
    detail = ["| llama.cpp type | -fa | K/V cache | depth | pp tok/s | tg tok/s | load before/after |",
              "|---|---:|---|---:|---:|---:|---|"]
    for (t, fa, cache, d), v in sorted(lc.items()):
        detail.append(f"| {t} | {fa} | {cache} | {d:,d} | {v.get('pp', float('nan')):.1f} | "
                      f"{v.get('tg', float('nan')):.1f} | {v.get('load', '?')} |")
    mxd = ["| mixqrt KV | depth | pp tok/s | tg tok/s | KV bytes/token | KV MiB at depth | depth fill s | peak RSS MiB "
           "| load before/after |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (kv, d), r in sorted(mx.items(), key=lambda x: (x[0][1], x[0][0])):
        mxd.append(f"| {kv} | {d:,d} | {r['pp_tok_s']:.1f} | {r['tg_tok_s']:.1f} | {r['kv_bytes_per_token']:,.0f} | "
                   f"{d * r['kv_bytes_per_token'] / 2**20:,.1f} | {r.get('depth_fill_seconds', 0):.0f} | "
                   f"{r['peak_rss_bytes'] / 2**20:,.0f} | {r['load']} |")
    m = machine_info()
    prov = provenance(" ".join(["python benchmarks/long_context.py"] + sys.argv[1:]))
    prov += (f"- pp = {a.n_prompt} prompt tokens, tg = {a.n_gen} greedy decode steps, both after `depth` tokens "
             f"in the cache (llama-bench's `-d`; random token ids on both sides), {a.threads} threads, "
             f"{a.repetitions} repetition(s); the load average (1 min) before/after each measurement is in its row; "
             f"the machine is shared (load at report time {m['loadavg'][0]:.2f})\n")
    plotted = bool(a.plot) and plot(mx, lc, depths, kvs, Path(a.plot))
    if plotted:
        rows.append(f"\n![pp and tg tok/s against depth]({Path(a.plot).name})")
    update_doc(DOC, {"long-context-speed": prov + "\n" + "\n".join(rows),
                     "long-context-mixqrt": "\n".join(mxd),
                     "long-context-lcpp": "\n".join(detail),
                     "long-context-prefill": report_long_prompts(a)}, "Long context")


def plot(mx, lc, depths, kvs, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'mixqrt[bench]'): no plot", file=sys.stderr)
        return False
    if not mx and not lc:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what, key in ((axes[0], "pp", "pp_tok_s"), (axes[1], "tg", "tg_tok_s")):
        for kv in kvs:
            pts = [(d, mx[(kv, d)][key]) for d in depths if (kv, d) in mx]
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"mixqrt KV {kv}")
        pts = [(d, b[0]) for d in depths for b in [best_lcpp(lc, d, what)] if b]
        if pts:
            ax.plot(*zip(*pts), "s--", label="llama.cpp best")
        ax.set_xlabel("depth (tokens in the KV cache)")
        ax.set_ylabel(f"{what} tok/s")
        ax.set_title("prompt processing" if what == "pp" else "decode")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}", file=sys.stderr)
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mxq", default=None, help="mixqrt's file (default: the test model's default-recipe .mxq)")
    p.add_argument("--gguf", default=None, help="the test GGUF llama.cpp's files are made from")
    p.add_argument("--gguf-dir", default="/tmp/longctx-lcpp", help="where llama.cpp's files are made and reused")
    p.add_argument("--depths", default="0,4096,16384,32768")
    p.add_argument("--kv-types", default="f32,f16", help="mixqrt KV types (comma list)")
    p.add_argument("--lcpp-types", default="Q4_0,Q3_K_M")
    p.add_argument("--fa", default="0,1")
    p.add_argument("--lcpp-caches", default=",".join(LCPP_CACHES))
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=32)
    p.add_argument("-r", "--repetitions", type=int, default=1)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--lock", default=None, metavar="FILE", help="hold flock(FILE) during each measurement")
    p.add_argument("--src", default=None, metavar="DIR",
                   help="the mixqrt source tree (a built checkout) the measurements run (default: this one)")
    p.add_argument("--pp-long", default="", metavar="N[,N]",
                   help="also time one prompt of N tokens at depth 0 (mixqrt bench -p N, llama-bench -p N -n 0): "
                        "prefill speed and mixqrt's peak RSS against file + KV + 200 MiB")
    p.add_argument("--skip-mixqrt", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--fresh", action="store_true", help="measure again what has a raw file already")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--plot", default=str(PLOT), help="'' for no plot")
    a = p.parse_args()
    if a.src:
        SRC["dir"] = str(Path(a.src).resolve())
    depths = [int(x) for x in a.depths.split(",") if x.strip()]
    longs = [int(x) for x in a.pp_long.split(",") if x.strip()]
    _N_PROMPT["n"] = a.n_prompt
    if not a.report_only:
        lock = Lock(a.lock)
        if not a.skip_llamacpp:
            from mixqrt.testing import model_path
            ggufs = prepare_ggufs(Path(a.gguf or model_path("qwen")), Path(a.gguf_dir), a.lcpp_types.split(","))
            have = read_lcpp()
            for d in depths:                       # depth first: the short runs of every config come early
                for t in a.lcpp_types.split(","):
                    for fa in (int(x) for x in a.fa.split(",")):
                        for cache in a.lcpp_caches.split(","):
                            if fa == 0 and cache != "f16":
                                continue           # a quantized V cache needs flash attention in llama.cpp
                            if a.fresh or (t, fa, cache, d) not in have:
                                run_lcpp(ggufs[t], t, fa, cache, d, a, lock)
            for n in longs:
                for t in a.lcpp_types.split(","):
                    for fa in (int(x) for x in a.fa.split(",")):
                        for cache in a.lcpp_caches.split(","):
                            if (fa or cache == "f16") and (a.fresh or not measured(lcpp_file(t, fa, cache, 0, n))):
                                run_lcpp(ggufs[t], t, fa, cache, 0, a, lock, n)
        if not a.skip_mixqrt:
            mxq = a.mxq or default_mxq()
            for d in depths:
                for kv in a.kv_types.split(","):
                    if a.fresh or not measured(mixqrt_file(kv, d)):
                        run_mixqrt(mxq, kv, d, a, lock)
            for n in longs:
                for kv in a.kv_types.split(","):
                    if a.fresh or not measured(mixqrt_file(kv, 0, n)):
                        run_mixqrt(mxq, kv, 0, a, lock, n)
    report(a)


def default_mxq() -> str:
    """The demo model's default-recipe file (what `mixqrt generate -p hi` makes and caches)."""
    from mixqrt.pipeline import prepare
    return str(prepare(None, None, progress=False))


if __name__ == "__main__":
    main()
