"""Engine throughput: single-request decode (engine vs the plain loop) and 1/4/8 concurrent requests.

    flock /work/bench.lock python benchmarks/engine.py --model M.mxq --threads 2
    python benchmarks/engine.py --model M.mxq --quick          # smoke run

1. Single request, alternated in one process: stream_generate (the plain single-sequence loop,
   what Pipeline ran before the engine) against Engine.submit (what Pipeline runs now), greedy,
   eos off, --tokens new tokens. Decode tok/s = tokens after the first / seconds after the first.
2. C concurrent requests (C = 1, 4, 8; distinct prompts; a consumer thread each): aggregate
   decode tok/s over the window where every request is decoding (after the last first token,
   until the first request finishes), and end to end (all tokens / submit-to-last-token seconds).
Tables go between the engine-throughput markers of docs/engine.md, raw results to
docs/data/engine-throughput.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, read_concurrently, update_doc, window_rates, write_json  # noqa: E402

from mixqrt.generation.engine import Engine  # noqa: E402
from mixqrt.generation.generate import stream_generate  # noqa: E402
from mixqrt.pipeline import LoadedModel  # noqa: E402

TOPICS = ["a binary search tree", "quicksort", "a web server", "unit tests", "a hash map", "matrix multiplication",
          "a tokenizer", "garbage collection", "the TCP handshake", "Dijkstra's algorithm"]


def prompt_ids(lm, i: int) -> list[int]:
    msgs = [{"role": "user", "content": f"Write a short Python example of {TOPICS[i % len(TOPICS)]}."}]
    return lm.tokenizer.encode(lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))


def single(lm, eng, ids, tokens: int, engine: bool) -> tuple[float, float]:
    """-> (decode tok/s of wall time, decode tokens per CPU-second of the whole process): on a
    shared machine the second is the steadier measure of what the path costs."""
    kw = dict(max_new_tokens=tokens, temperature=0.0, eos_token_ids=[])
    it = eng.submit(ids, **kw) if engine else stream_generate(lm.model, lm.tokenizer, ids, max_context=4096, **kw)
    last, cpu0 = None, None
    for last in it:
        if cpu0 is None:
            cpu0 = time.process_time()
    return last.generation_tps, (last.generation_tokens - 1) / (time.process_time() - cpu0)


def concurrent(lm, eng, c: int, tokens: int, offset: int) -> dict:
    ids = [prompt_ids(lm, offset + i) for i in range(c)]
    t0 = time.perf_counter()
    reqs = [eng.submit(p, max_new_tokens=tokens, temperature=0.0, eos_token_ids=[]) for p in ids]
    r = window_rates(read_concurrently(reqs), t0)
    return {k: r[k] for k in ("decode_tps", "e2e_tps", "ttft_max_s")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--single-reps", type=int, default=6)
    ap.add_argument("--skip-concurrent", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "data" / "engine-throughput.json"))
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.reps, a.single_reps = 16, 1, 1
    lm = LoadedModel(a.model, threads=a.threads)
    res = {"machine": machine_info(), "model": a.model, "threads": a.threads, "tokens": a.tokens,
           "command": " ".join(["python"] + sys.argv)}
    with Engine(lm, max_slots=8) as eng:
        ids = prompt_ids(lm, 0)
        single(lm, eng, ids, 8, True)                  # warm up: page in the weights
        plain, via = [], []
        for _ in range(a.single_reps):                 # alternated: plain, engine, plain, engine...
            plain.append(single(lm, eng, ids, a.tokens, False))
            via.append(single(lm, eng, ids, a.tokens, True))
        res["single"] = {"plain_tps": [x[0] for x in plain], "engine_tps": [x[0] for x in via],
                         "plain_tok_per_cpu_s": [x[1] for x in plain], "engine_tok_per_cpu_s": [x[1] for x in via]}
        print("single request:", {k: [round(x, 1) for x in v] for k, v in res["single"].items()})
        res["concurrent"] = {}
        for rep in range(0 if a.skip_concurrent else a.reps):
            for c in (1, 4, 8):
                r = concurrent(lm, eng, c, a.tokens, offset=rep)
                res["concurrent"].setdefault(str(c), []).append(r)
                print(f"rep {rep} C={c}: decode {r['decode_tps']:.1f} tok/s, e2e {r['e2e_tps']:.1f} tok/s, "
                      f"last first-token {r['ttft_max_s']:.2f}s")
        res["stats"] = eng.stats()
    write_json(a.out, res)
    write_doc(res)


def write_doc(res):
    med = statistics.median
    s = res["single"]
    m = res["machine"]
    lines = [f"{m.get('cpu_model')}, {res['threads']} threads, {m['date_utc']}, commit {m['git_commit']}, "
             f"model `{Path(res['model']).name}` (0.5B Qwen2.5-Coder, recipe 2356), {res['tokens']} new tokens "
             f"per request, greedy, eos off. Command: `{res['command']}`.", "",
             "Single request, alternated in one process (decode tok/s, median of "
             f"{len(s['plain_tps'])}):", "",
             "| path | decode tok/s (median) | runs | decode tokens per CPU-second (median) |",
             "|---|---:|---|---:|",
             f"| plain loop (stream_generate, the old Pipeline path) | {med(s['plain_tps']):.1f} | "
             f"{', '.join(f'{x:.1f}' for x in s['plain_tps'])} | {med(s['plain_tok_per_cpu_s']):.1f} |",
             f"| Engine.submit (the Pipeline path now) | {med(s['engine_tps']):.1f} | "
             f"{', '.join(f'{x:.1f}' for x in s['engine_tps'])} | {med(s['engine_tok_per_cpu_s']):.1f} |", "",
             f"Engine / plain: {med(s['engine_tps']) / med(s['plain_tps']):.3f} (wall), "
             f"{med(s['engine_tok_per_cpu_s']) / med(s['plain_tok_per_cpu_s']):.3f} (per CPU-second).", "",
             "Concurrent requests through one Engine (max_slots=8), aggregate tok/s, median of "
             f"{len(res['concurrent'].get('1', []))}:", "",
             "| concurrent requests | decode tok/s (all decoding) | vs 1 | end to end tok/s (incl. prefill) |",
             "|---:|---:|---:|---:|"]
    base = med(r["decode_tps"] for r in res["concurrent"]["1"]) if res["concurrent"] else 0
    for c, rs in res["concurrent"].items():
        d = med(r["decode_tps"] for r in rs)
        lines.append(f"| {c} | {d:.1f} | {d / base:.2f}x | {med(r['e2e_tps'] for r in rs):.1f} |")
    update_doc(ROOT / "docs" / "engine.md", {"engine-throughput": "\n".join(lines)})


if __name__ == "__main__":
    main()
