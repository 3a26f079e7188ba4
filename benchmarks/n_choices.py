"""n choices vs one: wall time of one request with n=4 against n=1 on the same prompt.

    flock /work/bench.lock python benchmarks/n_choices.py --model M.mxq --threads 2
    python benchmarks/n_choices.py --model M.mxq --quick             # smoke run

The n choices share one prefill (the other choices copy the prompt's KV rows) and decode as one
batch, so n=4 should cost far less than 4 requests (issue 31's bound: <= 1.6x n=1). The prompt is
the first --prompt-tokens tokens of README.md as a chat message; every choice samples
--max-tokens tokens (temperature 0.8, eos off, so all run to the end); the prompt cache is off
(kv_cache_bytes=0) so no run reuses another's prefill. n=1 and n=4 alternate, --reps times each.
Table between the server-n-choices markers of docs/server.md, raw results to
docs/data/server-n-choices.json.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, update_doc, write_json  # noqa: E402

import mixqrt  # noqa: E402


def prompt_ids(tok, n_tokens: int) -> list[int]:
    words = (ROOT / "README.md").read_text().split()
    text = " ".join(words)
    ids = tok.encode(text)[:n_tokens]
    msgs = [{"role": "user", "content": "Summarise this text:\n" + tok.decode(ids)}]
    return tok.encode_chat(msgs, add_generation_prompt=True)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one(eng, ids, n, max_tokens, seed):
    t0, c0 = time.perf_counter(), _cpu()
    out = list(eng.submit(ids, n=n, max_new_tokens=max_tokens, temperature=0.8, seed=seed, eos_token_ids=[]))
    dt, cpu = time.perf_counter() - t0, _cpu() - c0
    toks = sum(1 for r in out if r.token is not None)
    assert toks == n * max_tokens, (toks, n, max_tokens)
    return {"n": n, "wall_s": dt, "cpu_s": cpu, "tokens": toks, "ttft_s": out[0].ttft_s,
            "load_avg_1m": os.getloadavg()[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "data" / "server-n-choices.json"))
    a = ap.parse_args()
    if a.quick:
        a.prompt_tokens, a.max_tokens, a.reps = 32, 4, 1
    pipe = mixqrt.Pipeline(a.model, threads=a.threads, progress=False)
    eng = pipe.configure_engine(kv_cache_bytes=0, max_slots=max(8, a.n))
    ids = prompt_ids(pipe.tokenizer, a.prompt_tokens)
    one(eng, ids, 1, 2, 0)                                     # warm-up (first-call costs)
    runs = []
    for rep in range(a.reps):
        for n in (1, a.n):
            runs.append(one(eng, ids, n, a.max_tokens, rep))
            print(runs[-1], flush=True)
    pipe.close()
    res = {"machine": machine_info(), "model": a.model, "threads": a.threads, "prompt_tokens": len(ids),
           "max_tokens": a.max_tokens, "n": a.n, "runs": runs, "command": " ".join(["python"] + sys.argv)}
    write_json(a.out, res)
    if not a.quick:
        write_doc(res)


def write_doc(res):
    med = statistics.median
    m, k = res["machine"], res["n"]
    ones = [r for r in res["runs"] if r["n"] == 1]
    ks = [r for r in res["runs"] if r["n"] == k]
    w1, wn = med(r["wall_s"] for r in ones), med(r["wall_s"] for r in ks)
    c1, cn = med(r["cpu_s"] for r in ones), med(r["cpu_s"] for r in ks)
    pairs = sorted(b["wall_s"] / a["wall_s"] for a, b in zip(ones, ks))
    load = med(r["load_avg_1m"] for r in res["runs"])
    lines = [f"Measured: {m.get('cpu_model')}, {res['threads']} threads, {m['date_utc']}, commit {m['git_commit']}, "
             f"model `{Path(res['model']).name}` (0.5B Qwen2.5-Coder, recipe 2356). Command: `{res['command']}`. "
             f"Median of {len(ones)} alternated runs; prompt {res['prompt_tokens']} tokens, {res['max_tokens']} new "
             f"tokens per choice; load average during the runs ~{load:.0f} on 2 cores (other jobs), so wall "
             "times are noisy and the process CPU time is given too.", "",
             "| n | wall s | CPU s | tokens | wall vs n=1 | CPU vs n=1 |", "|---:|---:|---:|---:|---:|---:|",
             f"| 1 | {w1:.2f} | {c1:.2f} | {res['max_tokens']} | 1.00x | 1.00x |",
             f"| {k} | {wn:.2f} | {cn:.2f} | {k * res['max_tokens']} | {wn / w1:.2f}x | {cn / c1:.2f}x |", "",
             f"Per alternated pair, n={k} / n=1 wall: " + ", ".join(f"{p:.2f}" for p in pairs) + "."]
    update_doc(ROOT / "docs" / "server.md", {"server-n-choices": "\n".join(lines)})


if __name__ == "__main__":
    main()
