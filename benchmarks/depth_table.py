"""The side-by-side depth table of docs/long-context.md (mixqrt:long-context-depth) from one run of
benchmarks/depth_run.sh: `mixqrt bench --depth N` (mixqrt-KV-dN.json) and `llama-bench -d N`
(llama-*.jsonl, one file per configuration and several depths), raw files and the run's log (the
load average before each step) in one folder.

    bash benchmarks/depth_run.sh docs/data/long_context/round2      # measure (under the benchmark lock)
    python benchmarks/depth_table.py docs/data/long_context/round2  # write the table
    python benchmarks/depth_table.py docs/data/long_context/round4 long-context-depth4   # into another block

benchmarks/depth_ratio.py's files in the folder (ratio-TAG.json: decode at 16k against depth 0 in
alternating bursts) are listed under the table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance, update_doc  # noqa: E402
from long_context import DOC  # noqa: E402


def llama_rows(folder: Path) -> list[dict]:
    rows = []
    for p in sorted(folder.glob("llama-*.jsonl")):
        for line in p.read_text().splitlines():
            if line.strip().startswith("{"):
                d = json.loads(line)
                rows.append({"file": p.stem, "model": Path(d["model_filename"]).stem, "fa": d["flash_attn"],
                             "cache": d["type_k"], "depth": d["n_depth"], "pp": d["n_prompt"], "tg": d["n_gen"],
                             "tok_s": d["avg_ts"]})
    return rows


def best(rows, depth: int, kind: str, n_prompt=512):
    c = [r for r in rows if r["depth"] == depth and (r["tg"] > 0 if kind == "tg" else r["pp"] == n_prompt)]
    return max(c, key=lambda r: r["tok_s"]) if c else None


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "docs" / "data"
                  / "long_context" / "round2")
    lc = llama_rows(folder)
    mx = {}
    again = {}
    for p in folder.glob("mixqrt-*-d*.json"):
        kv, rest = p.stem.split("-")[1], p.stem.rsplit("-d", 1)[1]
        d, tag = (int(rest.split("-")[0]), rest.split("-", 1)[1]) if "-" in rest else (int(rest), None)
        try:
            r = json.loads(p.read_text().strip().splitlines()[-1])
        except (ValueError, IndexError):
            continue
        (again.setdefault(tag, {}) if tag else mx)[kv, d] = r
    depths = sorted({d for _, d in mx} | {r["depth"] for r in lc})
    out = ["| depth | mixqrt q4 pp512 | llama.cpp best pp512 | ratio | mixqrt q4 tg | llama.cpp best tg | ratio | "
           "q4 tg / its depth-0 tg |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    tg0 = mx.get(("q4", 0), {}).get("tg_tok_s")
    for d in depths:
        m = mx.get(("q4", d))
        bp, bt = best(lc, d, "pp"), best(lc, d, "tg")
        cell = lambda v: f"{v:.1f}" if v else "-"                                          # noqa: E731
        rp = f"{m['pp_tok_s'] / bp['tok_s']:.2f}x" if m and bp else "-"
        rt = f"{m['tg_tok_s'] / bt['tok_s']:.2f}x" if m and bt else "-"
        own = f"{m['tg_tok_s'] / tg0:.2f}x" if m and tg0 else "-"
        lbp = f"{bp['tok_s']:.1f} ({bp['model']}, fa {bp['fa']}, {bp['cache']})" if bp else "-"
        lbt = f"{bt['tok_s']:.1f} ({bt['model']}, fa {bt['fa']}, {bt['cache']})" if bt else "-"
        out.append(f"| {d:,d} | {cell(m and m['pp_tok_s'])} | {lbp} | {rp} | {cell(m and m['tg_tok_s'])} | {lbt} | "
                   f"{rt} | {own} |")
    extra = [f"| {kv} at {d:,d} | pp512 {r['pp_tok_s']:.1f}, tg {r['tg_tok_s']:.1f} tok/s |"
             for (kv, d), r in sorted(mx.items()) if kv != "q4"]
    extra += [f"| {kv} at {d:,d} ({tag}: measured again later in the run, the log says when) | pp512 {r['pp_tok_s']:.1f}, tg {r['tg_tok_s']:.1f} tok/s |"
              for tag, rows in sorted(again.items()) for (kv, d), r in sorted(rows.items())]
    long = folder / "mixqrt-q4-pp16384.json"
    lp = [r for r in lc if r["pp"] == 16384]
    if long.exists() and lp:
        try:
            m = json.loads(long.read_text().strip().splitlines()[-1])
            b = max(lp, key=lambda r: r["tok_s"])
            bound = m["file_bytes"] + 16384 * m["kv_bytes_per_token"] + (200 << 20)
            extra.append(f"| a 16,384-token prompt (pp16384) | mixqrt q4 {m['pp_tok_s']:.1f} tok/s, llama.cpp "
                         f"{b['tok_s']:.1f} ({b['model']}, fa {b['fa']}): {m['pp_tok_s'] / b['tok_s']:.2f}x; peak RSS "
                         f"{m['peak_rss_bytes'] / 2**20:.0f} MiB = {m['peak_rss_bytes'] / bound:.2f}x (file + KV + 200 MiB) |")
        except (ValueError, IndexError, KeyError):
            pass
    every = ["| llama.cpp run | depth | pp | tg | tok/s |", "|---|---:|---:|---:|---:|"]
    every += [f"| {r['model']} fa {r['fa']} {r['cache']} | {r['depth']:,d} | {r['pp']} | {r['tg']} | {r['tok_s']:.1f} |"
              for r in sorted(lc, key=lambda r: (r["depth"], r["file"]))]
    log = (folder / "log").read_text() if (folder / "log").exists() else ""
    runner = folder / "run.sh"              # a round's own runner, kept with its data
    prov = provenance(f"bash docs/data/long_context/{folder.name}/run.sh" if runner.exists()
                      else "bash benchmarks/depth_run.sh " + str(folder.name))
    ngen = sorted({r.get("n_gen", 32) for r in mx.values()} or {32})
    prov += (f"- 2 threads; mixqrt: the default q4a file, `mixqrt bench --depth N -p 512 -n {' or '.join(map(str, ngen))} "
             "-r 2` (the depth filled, not timed); llama.cpp: `llama-bench -d N` on its Q4_0 (and Q3_K_M at 0 / 16k), "
             "its best per depth\n")
    for p in sorted(folder.glob("ratio-*.json")):
        try:
            r = json.loads(p.read_text())
            extra.append(f"| decode at {r['depth']:,d} / depth 0, {len(r['rounds'])} alternated pairs of {r['burst']} steps "
                         f"({p.stem[6:]}; benchmarks/depth_ratio.py) | median {r['median_ratio']:.3f}x (min "
                         f"{r['min_ratio']:.3f}, max {r['max_ratio']:.3f}); depth 0 {r['median_zero_tok_s']:.1f}, "
                         f"depth {r['depth']:,d} {r['median_deep_tok_s']:.1f} tok/s |")
        except (ValueError, KeyError, OSError):
            continue
    body = prov + "\n" + "\n".join(out)
    if extra:
        body += "\n\n| other mixqrt KV types | |\n|---|---|\n" + "\n".join(extra)
    body += "\n\n" + "\n".join(every) + "\n\nThe run's log (load average before each step):\n\n```\n" + log + "```"
    update_doc(DOC, {sys.argv[2] if len(sys.argv) > 2 else "long-context-depth": body}, "Long context")
    print("\n".join(out))


if __name__ == "__main__":
    main()
