"""Speculative decoding: plain decode against prompt lookup and a draft model, three prompt sets.

    python benchmarks/speculative.py --target T.mxq [--draft D.mxq] [--lookup 8] --threads 2
    python benchmarks/speculative.py --target T.mxq --quick          # smoke run, writes nothing
    python benchmarks/speculative.py --target T.mxq --llama-gguf T.gguf   # + llama.cpp prompt lookup
    python benchmarks/speculative.py --target T.mxq --llama-server-gguf T.gguf \
        [--llama-server-draft D.gguf]                   # + llama-server's own speculation

Prompt sets (temperature 0, chat template, eos ends a reply, --max-tokens at most):
  editing  prompts that ask to change given code (add type hints, rename, add docstrings, convert a
           loop), built from this repository's own Python sources;
  free     the README's quicksort prompt and chat questions;
  prose    continue a given paragraph (README prose).
Per prompt, plain and each speculative setting run in alternation (--reps rounds) in one process,
so the machine's drift hits them alike; the output of each speculative run is compared token for
token with the plain run's. With --llama-gguf, llama-cpp-python's LlamaPromptLookupDecoding runs
the same prompts (its best --llama-lookup setting is reported) as the llama.cpp anchor. With
--llama-server-gguf, llama.cpp's own llama-server (one slot) runs the same token-id prompts plain,
with each of its n-gram speculation types (--llama-spec) and, with --llama-server-draft, with a draft
model; its own timings (predicted_per_second, draft_n, draft_n_accepted) are reported.
Table between the speculative-bench markers of docs/speculative.md, raw results to
docs/data/speculative.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, provenance, update_doc, write_json  # noqa: E402
from _llama_server import complete_ids, start_llama_server  # noqa: E402

import mixqrt  # noqa: E402

EDIT_TASKS = ["Add type hints to every function in this code and return the whole code.",
              "Rename the variable `s` to `text` everywhere in this code and return the whole code.",
              "Add a one-line docstring to every function that lacks one and return the whole code.",
              "Rewrite the first for loop in this code as a list comprehension where possible and "
              "return the whole code."]
EDIT_SOURCES = ["mixqrt/generation/speculative.py", "mixqrt/io/atomic.py", "mixqrt/models/config_limits.py", "mixqrt/generation/chat_template.py"]
FREE = ["def quicksort(arr):", "What is the difference between a process and a thread?",
        "Explain what a mutex is, in three sentences.", "Write a Python function that checks if a string "
        "is a palindrome."]


def _snippet(path: str, chars: int) -> str:
    text = (ROOT / path).read_text()
    start = text.find("\ndef ")
    return text[max(0, start):max(0, start) + chars].strip("\n")


def prompt_sets(chars: int) -> dict[str, list]:
    editing = [[{"role": "user", "content": f"{task}\n```python\n{_snippet(src, chars)}\n```"}]
               for task, src in zip(EDIT_TASKS, EDIT_SOURCES)]
    free = [FREE[0]] + [[{"role": "user", "content": q}] for q in FREE[1:]]
    readme = [p for p in (ROOT / "README.md").read_text().split("\n\n") if len(p) > 300 and not p.startswith(("```", "|"))]
    prose = [[{"role": "user", "content": "Continue this paragraph:\n\n" + p[:600]}] for p in readme[:4]]
    return {"editing": editing, "free": free, "prose": prose}


def run(pipe, prompt, max_tokens, draft_k=None):
    kw = {} if draft_k is None else {"draft_k": draft_k}
    t0 = time.perf_counter()
    pieces = list(pipe.stream(prompt, max_new_tokens=max_tokens, temperature=0, **kw))
    dt = time.perf_counter() - t0
    last = pieces[-1]
    toks = [p.token for p in pieces if p.token is not None]
    decode_s = max(1e-9, dt - last.ttft_s)
    return {"tokens": toks, "n": len(toks), "wall_s": dt, "ttft_s": last.ttft_s,
            "decode_tps": (len(toks) - 1) / decode_s if len(toks) > 1 else 0.0,
            "drafted": last.draft_tokens, "accepted": last.accepted_draft_tokens}


def llama_lookup(gguf, prompts_by_set, max_tokens, threads, settings):
    """llama-cpp-python's prompt-lookup decoding on the same prompts (rendered with mixqrt's
    template, fed as token ids): tokens/s per set for each num_pred_tokens setting."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    out = {}
    for npred in settings:
        llm = Llama(gguf, n_ctx=4096, n_threads=threads, verbose=False,
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=npred) if npred else None)
        for name, items in prompts_by_set.items():
            tps = []
            for ids in items:
                llm.reset()
                t0 = time.perf_counter()
                n = 0
                first = None
                for tok in llm.generate(ids, temp=0.0, top_k=1):
                    if first is None:
                        first = time.perf_counter()
                    if tok == llm.token_eos() or n >= max_tokens:
                        break
                    n += 1
                t1 = time.perf_counter()
                tps.append((n - 1) / max(1e-9, t1 - first) if n > 1 else 0.0)
            out.setdefault(name, {})[npred] = statistics.median(tps)
        del llm
    return out


LLAMA_SPEC = {"plain": [],
              # llama.cpp's defaults look up 12-token n-grams and draft 48 tokens (sized for GPUs);
              # the -nNmM settings use mixqrt's sizes (3-token n-grams, 8 drafts) and smaller
              "ngram-simple-n3m8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                    "--spec-ngram-simple-size-m", "8"],
              "ngram-simple-n3m16": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                     "--spec-ngram-simple-size-m", "16"],
              "ngram-simple-n2m4": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                                    "--spec-ngram-simple-size-m", "4"],
              "ngram-map-k-n3m8": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                                   "--spec-ngram-map-k-size-m", "8"],
              "ngram-simple": ["--spec-type", "ngram-simple"],
              "ngram-map-k": ["--spec-type", "ngram-map-k"],
              "ngram-mod": ["--spec-type", "ngram-mod"],
              "ngram-cache": ["--spec-type", "ngram-cache"]}


def llama_server_runs(gguf, prompts_by_set, max_tokens, threads, settings, draft=None, log_dir=Path("/tmp/speculative-llama-server")):
    """llama.cpp's own llama-server (one slot, greedy, no prompt cache) on the same token-id prompts,
    plain and with each speculation setting (llama.cpp's own defaults for each): per setting and set, its decode tok/s per prompt
    (timings.predicted_per_second), drafted and accepted tokens, and whether the output equals its
    own plain run's."""
    runs = {s: LLAMA_SPEC[s] for s in settings}
    if draft:
        runs[f"draft {Path(draft).name}"] = ["--model-draft", draft, "-td", str(threads), "-tbd", str(threads)]
    out, plain_tokens = {}, {}
    for label, extra in runs.items():
        with start_llama_server(f"llama-server-{label.split()[0]}", gguf, threads, 4096, log_dir,
                                extra=extra) as srv:
            srv.wait_ready()
            complete_ids(srv.url, [1, 2, 3], 4)                      # warm-up
            for name, items in prompts_by_set.items():
                for i, ids in enumerate(items):
                    r = complete_ids(srv.url, ids, max_tokens)
                    t = r.get("timings", {})
                    toks = r.get("tokens") or []
                    if label == "plain":
                        plain_tokens[(name, i)] = toks
                    out.setdefault(label, {}).setdefault(name, []).append(
                        {"decode_tps": t.get("predicted_per_second", 0.0), "n": t.get("predicted_n"),
                         "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                         "identical": toks == plain_tokens.get((name, i))})
        print("llama-server", label, {k: statistics.median(x["decode_tps"] for x in v) for k, v in out[label].items()},
              flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="the model to speed up (.mxq or anything Pipeline takes)")
    ap.add_argument("--draft", default=None, help="a draft model with the same tokenizer")
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--chars", type=int, default=900, help="characters of source code per editing prompt")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--llama-gguf", default=None, help="run llama.cpp's prompt lookup on this GGUF too")
    ap.add_argument("--llama-lookup", default="0,4,8,10", help="llama.cpp num_pred_tokens settings (0 = plain)")
    ap.add_argument("--llama-server-gguf", default=None,
                    help="run llama.cpp's llama-server on this GGUF: plain and with its speculation types")
    ap.add_argument("--llama-server-draft", default=None, help="llama-server --model-draft for its draft run")
    ap.add_argument("--llama-spec", default="plain,ngram-simple-n3m8,ngram-simple-n2m4,ngram-map-k-n3m8",
                    help=f"llama-server settings, of {', '.join(LLAMA_SPEC)}")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tag", default="", help="names this run's table (docs/speculative.md marker "
                    "speculative-bench-TAG) and raw results (docs/data/speculative-TAG.json), so runs with other "
                    "targets keep their own")
    ap.add_argument("--out", default=None, help="raw results (default: docs/data/speculative[-TAG].json)")
    a = ap.parse_args()
    suffix = f"-{a.tag}" if a.tag else ""
    a.out = a.out or str(ROOT / "docs" / "data" / f"speculative{suffix}.json")
    if a.quick:
        a.max_tokens, a.chars = 24, 300
    sets = prompt_sets(a.chars)
    if a.quick:
        sets = {k: v[:1] for k, v in sets.items()}
    pipes = {"plain": mixqrt.Pipeline(a.target, threads=a.threads, progress=False)}
    pipes[f"lookup {a.lookup}"] = mixqrt.Pipeline(a.target, threads=a.threads, progress=False, lookup=a.lookup)
    if a.draft:
        pipes[f"draft k={a.draft_k}"] = mixqrt.Pipeline(a.target, threads=a.threads, progress=False,
                                                        draft=a.draft, draft_k=a.draft_k)
    for p in pipes.values():
        p.configure_engine(kv_cache_bytes=0)          # no run reuses another's prefill
    for p in pipes.values():
        run(p, "Hello", 4)                              # warm-up
    results = []
    for rep in range(a.reps):
        for name, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                base = None
                for label, pipe in pipes.items():
                    r = run(pipe, prompt, a.max_tokens)
                    if label == "plain":
                        base = r["tokens"]
                    r.update(set=name, prompt=i, setting=label, rep=rep, identical=r["tokens"] == base,
                             load_avg_1m=os.getloadavg()[0])
                    toks = r.pop("tokens")
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()},
                          len(toks), flush=True)
                    results.append(r)
    for p in pipes.values():
        p.close()
    llama = None
    tok = pipes["plain"].tokenizer
    enc = {name: [tok.encode_chat(p, add_generation_prompt=True) if not isinstance(p, str) else tok.encode(p)
                  for p in prompts] for name, prompts in sets.items()}    # the same ids for llama.cpp
    if a.llama_gguf:
        llama = llama_lookup(a.llama_gguf, enc, a.max_tokens, a.threads,
                             [int(x) for x in a.llama_lookup.split(",")])
        print("llama.cpp", llama, flush=True)
    server = None
    if a.llama_server_gguf:
        server = llama_server_runs(a.llama_server_gguf, enc, a.max_tokens, a.threads, a.llama_spec.split(","),
                                   draft=a.llama_server_draft)
    res = {"machine": machine_info(), "target": a.target, "draft": a.draft, "threads": a.threads,
           "max_tokens": a.max_tokens, "results": results, "llama_cpp": llama, "llama_server": server,
           "llama_server_gguf": a.llama_server_gguf, "llama_server_draft": a.llama_server_draft,
           "command": " ".join(["python"] + sys.argv)}
    if a.quick:
        return
    write_json(a.out, res)
    write_doc(res, list(pipes), f"speculative-bench{suffix}")


def write_doc(res, settings, marker="speculative-bench"):
    med = statistics.median
    lines = [provenance(res["command"]),
             f"Target `{Path(res['target']).name}`" + (f", draft `{Path(res['draft']).name}`" if res["draft"] else "")
             + f"; temperature 0, at most {res['max_tokens']} new tokens; decode tok/s after the first token, "
             "median over the set's prompts; speed-up = per-prompt ratio to plain, median; end to end = the "
             "same for the whole request's wall time (prompt included); TTFT vs plain = time to first token "
             "against plain's (a draft model reads the prompt in that time).", "",
             "| set | setting | decode tok/s | speed-up | end to end | TTFT vs plain | drafts accepted | identical to plain |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for name in ("editing", "free", "prose"):
        rows = [r for r in res["results"] if r["set"] == name]
        if not rows:
            continue
        plain = {(r["prompt"], r["rep"]): r for r in rows if r["setting"] == "plain"}
        for s in settings:
            rs = [r for r in rows if r["setting"] == s]
            tps = med(r["decode_tps"] for r in rs)
            up = med(r["decode_tps"] / max(1e-9, plain[(r["prompt"], r["rep"])]["decode_tps"]) for r in rs)
            d, acc = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
            ident = sum(r["identical"] for r in rs)
            e2e = med(plain[(r["prompt"], r["rep"])]["wall_s"] / max(1e-9, r["wall_s"]) for r in rs)
            ttft = med(r["ttft_s"] / max(1e-9, plain[(r["prompt"], r["rep"])]["ttft_s"]) for r in rs)
            lines.append(f"| {name} | {s} | {tps:.1f} | {up:.2f}x | {e2e:.2f}x | {ttft:.2f}x | {acc}/{d} | "
                         f"{ident}/{len(rs)} |")
    if res.get("llama_cpp"):
        lines += ["", "llama.cpp (llama-cpp-python, `LlamaPromptLookupDecoding(num_pred_tokens=N)`, N = 0: plain), "
                  "decode tok/s, median over the set's prompts:", "",
                  "| set | " + " | ".join(f"N={n}" for n in next(iter(res["llama_cpp"].values()))) + " |",
                  "|---|" + "---:|" * len(next(iter(res["llama_cpp"].values())))]
        for name, by in res["llama_cpp"].items():
            lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in by.values()) + " |")
    if res.get("llama_server"):
        lines += ["", f"llama.cpp's own llama-server on `{Path(res['llama_server_gguf']).name}` (one slot, greedy, "
                  "the same token-id prompts), its own timings: decode tok/s (median over the set's prompts), "
                  "speed-up against its plain run (per prompt, median), drafts accepted, output identical to "
                  "its plain run:", "",
                  "| set | setting | decode tok/s | speed-up | drafts accepted | identical to plain |",
                  "|---|---|---:|---:|---:|---|"]
        plain = res["llama_server"].get("plain", {})
        for label, by in res["llama_server"].items():
            for name, rs in by.items():
                tps = med(r["decode_tps"] for r in rs)
                up = (med(r["decode_tps"] / max(1e-9, p["decode_tps"]) for r, p in zip(rs, plain[name]))
                      if name in plain else float("nan"))
                lines.append(f"| {name} | {label} | {tps:.1f} | {up:.2f}x | {sum(r['accepted'] for r in rs)}/"
                             f"{sum(r['drafted'] for r in rs)} | {sum(r['identical'] for r in rs)}/{len(rs)} |")
    update_doc(ROOT / "docs" / "speculative.md", {marker: "\n".join(lines)})


if __name__ == "__main__":
    main()
