"""Prompt cache: time to first token of a chat's second turn, cache on vs off.

    flock /work/bench.lock python benchmarks/prompt_cache.py --model M.mxq --threads 2
    python benchmarks/prompt_cache.py --model M.mxq --quick          # smoke run

Turn 1: a system prompt and a user message holding ~--turn1 tokens of tinyshakespeare, answered
with --answer greedy tokens. Turn 2: the whole conversation (the answer re-rendered by the chat
template) plus a short new user message. Each rep runs both turns on a Pipeline whose engine has
the prompt cache on (default kv_cache_bytes) and on one with it off (kv_cache_bytes=0),
alternated; the TTFT of turn 2 is the number compared. Tables go between the
engine-prompt-cache markers of docs/engine.md, raw results to docs/data/engine-prompt-cache.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, update_doc, write_json  # noqa: E402

import mixqrt  # noqa: E402

TEXT = ROOT / "tests" / "data" / "tinyshakespeare.txt"


def conversation(tok, n_tokens: int, text: str):
    words = Path(text).read_text().split()
    lo, hi = 10, len(words)
    while lo < hi:                       # the longest excerpt whose turn-1 prompt fits n_tokens
        mid = (lo + hi + 1) // 2
        msgs = [{"role": "system", "content": "You are a careful literary assistant."},
                {"role": "user", "content": "Summarise this scene:\n" + " ".join(words[:mid])}]
        if len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
        if hi - lo < 4:
            break
    return [{"role": "system", "content": "You are a careful literary assistant."},
            {"role": "user", "content": "Summarise this scene:\n" + " ".join(words[:lo])}]


def chat(pipe, msgs, answer: int):
    pieces = list(pipe.stream(msgs, max_new_tokens=answer, temperature=0.0))
    last = pieces[-1]
    return "".join(p.text for p in pieces), pieces[0].ttft_s, last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turn1", type=int, default=1000)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--text", default=str(TEXT), help="turn-1 text (not evaluation text)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "data" / "engine-prompt-cache.json"))
    a = ap.parse_args()
    if a.quick:
        a.turn1, a.answer, a.reps = 200, 4, 1
    pipe = mixqrt.Pipeline(a.model, threads=a.threads, progress=False)
    msgs = conversation(pipe.tokenizer, a.turn1, a.text)
    runs = {"on": [], "off": []}
    for rep in range(a.reps):
        for mode in ("on", "off"):
            pipe.configure_engine(kv_cache_bytes=None if mode == "on" else 0)
            ans, ttft1, last1 = chat(pipe, msgs, a.answer)
            turn2 = msgs + [{"role": "assistant", "content": ans},
                            {"role": "user", "content": f"Now in one sentence, please ({rep})."}]
            _, ttft2, last2 = chat(pipe, turn2, 8)
            runs[mode].append({"turn1_prompt_tokens": last1.prompt_tokens, "turn1_ttft_s": ttft1,
                               "turn2_prompt_tokens": last2.prompt_tokens, "turn2_cached_tokens": last2.cached_tokens,
                               "turn2_ttft_s": ttft2})
            print(mode, runs[mode][-1])
    pipe.close()
    res = {"machine": machine_info(), "model": a.model, "threads": a.threads, "runs": runs,
           "command": " ".join(["python"] + sys.argv)}
    write_json(a.out, res)
    write_doc(res)


def write_doc(res):
    med = statistics.median
    m, on, off = res["machine"], res["runs"]["on"], res["runs"]["off"]
    t_on, t_off = med(r["turn2_ttft_s"] for r in on), med(r["turn2_ttft_s"] for r in off)
    lines = [f"{m.get('cpu_model')}, {res['threads']} threads, {m['date_utc']}, commit {m['git_commit']}, "
             f"model `{Path(res['model']).name}` (0.5B Qwen2.5-Coder, recipe 2356). Command: `{res['command']}`. "
             "Cache on and off alternated in one process; median of "
             f"{len(on)} runs.", "",
             "| prompt cache | turn 1 prompt tokens | turn 1 TTFT s | turn 2 prompt tokens | turn 2 cached tokens "
             "| turn 2 TTFT s |", "|---|---:|---:|---:|---:|---:|"]
    for name, rs in (("on", on), ("off (kv_cache_bytes=0)", off)):
        lines.append(f"| {name} | {rs[0]['turn1_prompt_tokens']} | {med(r['turn1_ttft_s'] for r in rs):.3f} | "
                     f"{rs[0]['turn2_prompt_tokens']} | {rs[0]['turn2_cached_tokens']} | "
                     f"{med(r['turn2_ttft_s'] for r in rs):.3f} |")
    lines += ["", f"Second-turn time to first token: {t_off / t_on:.1f}x faster with the cache "
                  f"({t_off:.3f} s -> {t_on:.3f} s)."]
    update_doc(ROOT / "docs" / "engine.md", {"engine-prompt-cache": "\n".join(lines)})


if __name__ == "__main__":
    main()
