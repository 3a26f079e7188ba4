"""Load test of OpenAI-compatible servers: N concurrent clients (the official `openai` client), a
fixed mix of chat prompts with shared prefixes, for a fixed time; mixqrt's server against llama.cpp's
own `llama-server` (parallel slots, continuous batching) and llama-cpp-python's server, on the same
weights, alternated in one run.

    flock /work/bench.lock python benchmarks/serve_load.py --mxq /tmp/server-2356.mxq \
        --gguf /tmp/lcpp/qwen-Q4_0.gguf --systems mixqrt,mixqrt-lookup,llama-server --clients 1,4,8 -t 2

Systems: `mixqrt` (mixqrt serve, --max-slots slots), `mixqrt-lookup` (the same with prompt-lookup
speculation, --lookup N), `mixqrt-tiles` (the GEMM tile cache on), `llama-server` (llama.cpp's
server, `-np --np -cb`, --ctx tokens per slot; benchmarks/llamacpp_build.sh builds it,
$MIXQRT_LLAMA_CPP_BIN finds it) and `llamacpp` (llama-cpp-python's server, one request at a time).
With --gguf omitted the llama.cpp Q3_K_M is made from --source (the test Q4_K_M GGUF) by
benchmarks/compare_llamacpp.py's helper (llama_model_quantize, requantizing the dequantized weights).
--workload shared-system (issue 41): every request carries the same ~4,000-token system prompt
(--system-tokens) and its own question, one turn; mixqrt serve with --kv-type, against llama-server
with its f16 cache (`llama-server`) and q8_0 cache (`llama-server-q8`, -fa on); the table goes into
docs/long-context.md (mixqrt:long-context-serve) and the raw results to
docs/data/long_context/serve_shared_system.json:

    flock LOCKFILE python benchmarks/serve_load.py --workload shared-system --mxq M.mxq --gguf Q4_0.gguf \
        --systems mixqrt,llama-server,llama-server-q8 --clients 8 --kv-type f16

Reports per system and client count: aggregate output tok/s (tokens received inside the window /
window), p50/p99 time to first token and inter-token latency, errors, and the prompt-cache hit rate
(usage.prompt_tokens_details.cached_tokens / prompt tokens, where the server reports it). Writes the
tables between the `mixqrt:serving-*` markers of docs/lab/serve-load.md (the prose there is by hand),
docs/lab/serve-load.png and docs/data/serving.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine_info, update_doc, write_json  # noqa: E402
from _llama_server import ServerProc, free_port, llama_server_cmd  # noqa: E402

SYSTEM = ("You are a careful senior Python engineer. Answer with short, correct code and one sentence of "
          "explanation. Prefer the standard library, type hints and small functions. Never invent APIs; "
          "if something is ambiguous, state the assumption you made in a comment. Keep answers under "
          "twenty lines. The project uses Python 3.11, pytest for tests, and black formatting.")
QUESTIONS = ["Write a function that reverses a singly linked list.",
             "Write a function that checks whether a string is a palindrome, ignoring case and spaces.",
             "Write a binary search over a sorted list that returns the insertion index.",
             "Write a function that merges two sorted lists into one sorted list.",
             "Write a function that counts word frequencies in a text file.",
             "Write a generator that yields Fibonacci numbers forever.",
             "Write a function that flattens a nested list of integers.",
             "Write a function that parses an ISO 8601 date string into a datetime."]
FOLLOW_UP = "Now add a pytest test for it."


SYSTEMS = ("mixqrt", "mixqrt-lookup", "mixqrt-tiles", "llama-server", "llama-server-q8", "llamacpp")
MORE_QUESTIONS = ["Write a function that removes duplicates from a list while keeping the order.",
                  "Write a context manager that times a block of code.",
                  "Write a function that validates an IPv4 address string.",
                  "Write a function that chunks an iterable into lists of n items.",
                  "Write a function that computes the Levenshtein distance of two strings.",
                  "Write a decorator that retries a function three times on an exception.",
                  "Write a function that reads a CSV file into a list of dicts.",
                  "Write a function that returns the n most common words of a text."]
CONVS: list | None = None      # the workload's conversations (None: conversations())


def long_system_prompt(tokenizer, n_tokens: int) -> str:
    """A deterministic project handbook of about n_tokens tokens (numbered rules, no repetition of a
    whole sentence), cut at a token boundary."""
    topics = ["naming", "errors", "logging", "tests", "types", "imports", "docstrings", "performance",
              "security", "concurrency", "I/O", "configuration", "packaging", "review", "APIs", "data"]
    verbs = ["prefer", "avoid", "document", "check", "measure", "isolate", "name", "bound"]
    parts, i = ["Project handbook. Follow every rule below when you answer.\n"], 0
    while True:
        t, v = topics[i % len(topics)], verbs[(i // len(topics)) % len(verbs)]
        parts.append(f"Rule {i + 1} ({t}): {v} the {t} choices in module {i % 37} of package p{i % 11}; "
                     f"a change to them needs test case {1000 + 7 * i} and reviewer number {i % 5 + 1}.\n")
        i += 1
        if i % 16 == 0:
            ids = tokenizer.encode("".join(parts), add_special_tokens=False)
            if len(ids) >= n_tokens:
                return tokenizer.decode(ids[:n_tokens])


def shared_system_conversations(system: str) -> list[list[dict]]:
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in QUESTIONS + MORE_QUESTIONS]
TILES_BYTES = 1 << 30   # mixqrt-tiles: the GEMM tile cache on (serve's default is off)


def conversations() -> list[list[dict]]:
    """The fixed mix: every prompt shares the system prefix; half are a second turn of another."""
    out = []
    for i, q in enumerate(QUESTIONS):
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        out.append(first)
        if i % 2 == 0:
            answer = "def solution(*args):\n    ...  # see above\n"
            out.append(first + [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}])
    return out


def engine_counters(url: str) -> dict:
    """mixqrt's engine step counters from /metrics ({} for a server without them)."""
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        for key in ("steps", "decode_tokens"):
            if line.startswith(f"mixqrt_{key}_total"):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def new_record() -> dict:
    return {"tokens_in_window": 0, "ttft": [], "itl": [], "errors": 0, "requests": 0, "prompt_tokens": 0,
            "cached_tokens": 0, "error_kinds": {}, "censored": 0, "seconds": 0.0, "steps": 0.0,
            "decode_tokens": 0.0, "rounds": []}


def run_load(url: str, clients: int, seconds: float, max_tokens: int, seed: int = 0) -> dict:
    """One window of `seconds` -> its summary (see load_window)."""
    rec = new_record()
    load_window(url, clients, seconds, max_tokens, rec)
    return summarize(rec)


def load_window(url: str, clients: int, seconds: float, max_tokens: int, rec: dict) -> None:
    """`clients` threads each streaming chat completions back to back until the window closes;
    adds what they saw (and the engine's step counters) to `rec`."""
    from openai import OpenAI

    convs = CONVS or conversations()
    t_start = time.perf_counter() + 0.5
    t_end = t_start + seconds
    lock = threading.Lock()
    tokens_before = rec["tokens_in_window"]

    def client(ci: int):
        oc = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        k = 0
        while time.perf_counter() < t_start:
            time.sleep(0.001)
        while time.perf_counter() < t_end:
            msgs = convs[(ci * 5 + k) % len(convs)]
            k += 1
            t0 = time.perf_counter()
            last, ttft, itl, n_win, usage = None, None, [], 0, None
            try:
                # the window's end cuts waiting and running requests alike (a timeout after it is no error)
                stream = oc.with_options(timeout=max(1.0, t_end - t0 + 1.0)).chat.completions.create(
                    model="m", messages=msgs, max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if not chunk.choices or not chunk.choices[0].delta.content:
                        continue
                    now = time.perf_counter()
                    if now > t_end:
                        stream.close()
                        break
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
                    n_win += 1
            except Exception as e:  # noqa: BLE001 - counted and reported
                if time.perf_counter() < t_end:
                    with lock:
                        rec["errors"] += 1
                        kind = type(e).__name__
                        rec["error_kinds"][kind] = rec["error_kinds"].get(kind, 0) + 1
                    time.sleep(0.2)
                    continue
            if ttft is None and time.perf_counter() >= t_end:
                with lock:                          # still waiting when the window closed: TTFT >= this
                    rec["ttft"].append(t_end - t0)
                    rec["censored"] += 1
                continue
            with lock:
                rec["requests"] += 1
                rec["tokens_in_window"] += n_win
                if ttft is not None:
                    rec["ttft"].append(ttft)
                rec["itl"] += itl
                if usage is not None:
                    rec["prompt_tokens"] += usage.prompt_tokens
                    details = getattr(usage, "prompt_tokens_details", None)
                    rec["cached_tokens"] += int(getattr(details, "cached_tokens", 0) or 0) if details else 0

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    c0 = engine_counters(url)
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 900)
    c1 = engine_counters(url)
    rec["seconds"] += seconds
    rec["rounds"].append((rec["tokens_in_window"] - tokens_before) / seconds)
    if c0 and c1:
        rec["steps"] += c1["steps"] - c0["steps"]
        rec["decode_tokens"] += c1["decode_tokens"] - c0["decode_tokens"]


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(rec: dict) -> dict:
    seconds = rec["seconds"]
    out = {"tok_s": rec["tokens_in_window"] / seconds, "tok_s_rounds": rec["rounds"],
           "requests": rec["requests"], "errors": rec["errors"],
            "error_kinds": rec["error_kinds"], "ttft_censored": rec["censored"],
            "ttft_p50": pct(rec["ttft"], 50), "ttft_p99": pct(rec["ttft"], 99),
            "itl_p50": pct(rec["itl"], 50), "itl_p99": pct(rec["itl"], 99),
            "cache_hit_rate": (rec["cached_tokens"] / rec["prompt_tokens"]) if rec["prompt_tokens"] else None}
    if rec["steps"] > 0:
        out["mean_batch"] = rec["decode_tokens"] / rec["steps"]
        out["steps_per_s"] = rec["steps"] / seconds
    return out


def make_q3km(source: str, threads: int) -> str:
    from compare_llamacpp import System, prepare_llamacpp
    out = prepare_llamacpp(System("llamacpp", "Q3_K_M"), {"lcpp_dir": "/tmp/lcpp", "lcpp_prefix": "qwen",
                                                          "model": os.path.abspath(source), "threads": threads})
    return out["path"]


def _f(v, spec):
    return "–" if v is None else spec.format(v)


def write_shared_system_report(res: dict, a, info: dict, cmd: str) -> None:
    """--workload shared-system: the table into docs/long-context.md, raw results beside the page's data."""
    docs = ROOT / "docs"
    write_json(docs / "data" / "long_context" / "serve_shared_system.json",
               {"results": res, "machine": info, "command": cmd, "system_tokens": a.system_tokens})
    labels = {"mixqrt": f"mixqrt serve --kv-type {a.kv_type or 'default'} ({a.max_slots} slots)",
              "llama-server": f"llama-server -np {a.np} -cb, f16 cache ({Path(a.gguf).name})",
              "llama-server-q8": f"llama-server -np {a.np} -cb -fa on, q8_0 cache ({Path(a.gguf).name})"}
    run = [f"- command: `{cmd}`", f"- machine: {info.get('cpu_model')}, {info.get('usable_cpus')} usable CPUs, "
           f"ISA {info.get('isa')}; {info.get('date_utc')}, commit {info.get('git_commit')}; load average at start "
           f"{', '.join(f'{x:.1f}' for x in info.get('loadavg', ()))}",
           f"- a {a.system_tokens}-token system prompt shared by every request, 16 different questions, one turn, "
           f"max_tokens {a.max_tokens}, greedy, {a.seconds:g} s per point in {a.rounds} window(s), {a.threads} threads", ""]
    T = ["| server | clients | output tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | requests | errors | cache hit |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in ("mixqrt", "llama-server", "llama-server-q8"):
        for n in a.clients:
            r = res.get(name, {}).get(str(n))
            if r is not None:
                T.append(f"| {labels[name]} | {n} | {r['tok_s']:.1f} | {_f(r['ttft_p50'], '{:.2f}')} | "
                         f"{_f(r['ttft_p99'], '{:.2f}')} | {_f(r['itl_p50'] and r['itl_p50'] * 1e3, '{:.0f}')} | "
                         f"{r['requests']} | {r['errors']} | "
                         f"{_f(r['cache_hit_rate'] and 100 * r['cache_hit_rate'], '{:.0f} %')} |")
    hi = str(max(a.clients))
    m = res.get("mixqrt", {}).get(hi)
    best = max((res.get(x, {}).get(hi) for x in ("llama-server", "llama-server-q8") if res.get(x, {}).get(hi)),
               key=lambda r: r["tok_s"], default=None)
    if m and best and best["tok_s"]:
        x = m["tok_s"] / best["tok_s"]
        T.append(f"\n{hi} clients, mixqrt vs llama-server's best cache type: {m['tok_s']:.1f} / {best['tok_s']:.1f} "
                 f"tok/s = {x:.2f}x (issue 41's goal: >= 1.5x): {'PASS' if x >= 1.5 else 'FAIL'}")
    update_doc(docs / "long-context.md", {"long-context-serve": "\n".join(run + T)}, "Long context")


def write_report(res: dict, a, info: dict, cmd: str) -> None:
    docs = ROOT / "docs"
    write_json(docs / "data" / "serving.json", {"results": res, "machine": info, "command": cmd})
    labels = {"mixqrt": f"mixqrt serve ({Path(a.mxq).name}, {a.max_slots} slots)",
              "mixqrt-lookup": f"mixqrt serve --lookup {a.lookup} ({a.max_slots} slots)",
              "mixqrt-tiles": f"mixqrt serve, --gemm-cache-bytes {TILES_BYTES} ({a.max_slots} slots)",
              "llama-server": f"llama-server -np {a.np} -cb ({Path(a.gguf).name})",
              "llama-server-q8": f"llama-server -np {a.np} -cb -fa on, q8_0 cache ({Path(a.gguf).name})",
              "llamacpp": f"llama-cpp-python server ({Path(a.gguf).name})"}
    run = [f"Run {info.get('date_utc')} (commit {info.get('git_commit')}): {info.get('cpu_model')}, "
           f"{info.get('usable_cpus')} usable CPUs, ISA {info.get('isa')}, load average at start "
           f"{', '.join(f'{x:.1f}' for x in info.get('loadavg', ()))}; llama-cpp-python "
           f"{info.get('llama_cpp_python')}; {a.threads} threads each, {a.seconds:g} s per point, max_tokens "
           f"{a.max_tokens}, greedy; each point's seconds split into {a.rounds} window(s) run round-robin over "
           f"all points (tok/s per window in docs/data/serving.json).", "", f"Command: `{cmd}`"]
    T = ["| server | clients | output tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | "
         "requests | still waiting at the end | errors | cache hit | decode batch (mean) | steps/s |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in SYSTEMS:
        for n in a.clients:
            r = res.get(name, {}).get(str(n))
            if r is None:
                continue
            T.append(f"| {labels[name]} | {n} | {r['tok_s']:.1f} | {_f(r['ttft_p50'], '{:.2f}')} | "
                     f"{_f(r['ttft_p99'], '{:.2f}')} | {_f(r['itl_p50'] and r['itl_p50'] * 1e3, '{:.0f}')} | "
                     f"{_f(r['itl_p99'] and r['itl_p99'] * 1e3, '{:.0f}')} | {r['requests']} | {r.get('ttft_censored', 0)} | "
                     f"{r['errors']} | "
                     f"{_f(r['cache_hit_rate'] and 100 * r['cache_hit_rate'], '{:.0f} %')} | "
                     f"{_f(r.get('mean_batch'), '{:.2f}')} | {_f(r.get('steps_per_s'), '{:.1f}')} |")
    G = []
    hi = str(max(a.clients))
    at = {name: res.get(name, {}).get(hi) for name in SYSTEMS}
    m1, mh = res.get("mixqrt", {}).get("1"), at["mixqrt"]
    if m1 and mh:
        x = mh["tok_s"] / m1["tok_s"] if m1["tok_s"] else float("nan")
        G.append(f"- {hi} clients vs 1 client, mixqrt: {mh['tok_s']:.1f} / {m1['tok_s']:.1f} tok/s = {x:.2f}x "
                 f"(goal >= 2.0x): {'PASS' if x >= 2.0 else 'FAIL'}")
    for anchor, goal in (("llama-server", 1.2), ("llamacpp", 2.0)):
        lh = at[anchor]
        if not (mh and lh):
            continue
        x = mh["tok_s"] / lh["tok_s"] if lh["tok_s"] else float("nan")
        G.append(f"- {hi} clients, mixqrt vs {labels[anchor]}: {mh['tok_s']:.1f} / {lh['tok_s']:.1f} tok/s = "
                 f"{x:.2f}x (goal >= {goal}x): {'PASS' if x >= goal else 'FAIL'}")
        if mh["ttft_p99"] is not None and lh["ttft_p99"] is not None:
            G.append(f"- {hi} clients, p99 TTFT: mixqrt {mh['ttft_p99']:.2f} s vs {anchor} "
                     f"{lh['ttft_p99']:.2f} s (goal: no worse): {'PASS' if mh['ttft_p99'] <= lh['ttft_p99'] else 'FAIL'}")
    sp = at["mixqrt-lookup"]
    if mh and sp:
        x = sp["tok_s"] / mh["tok_s"] if mh["tok_s"] else float("nan")
        G.append(f"- {hi} clients, mixqrt with prompt lookup vs without: {sp['tok_s']:.1f} / {mh['tok_s']:.1f} "
                 f"tok/s = {x:.2f}x (goal: no slower; >= 0.95x, this machine's window-to-window noise): "
                 f"{'PASS' if x >= 0.95 else 'FAIL'}")
    update_doc(docs / "lab" / "serve-load.md", {"serving-run": "\n".join(run), "serving-table": "\n".join(T),
                                     "serving-goals": "\n".join(G) or "(not measured)"},
               title="Serving under load: mixqrt serve against llama-cpp-python's server")
    write_plot(docs / "lab" / "serve-load.png", res, a.clients, labels)


def write_plot(path, res, clients, labels) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("mixqrt", "o-"), ("mixqrt-lookup", "v-"), ("mixqrt-tiles", "^:"),
                        ("llama-server", "D-."), ("llamacpp", "s--")):
        ns = [n for n in clients if str(n) in res.get(name, {})]
        if not ns:
            continue
        ax1.plot(ns, [res[name][str(n)]["tok_s"] for n in ns], style, label=labels[name])
        ax2.plot(ns, [res[name][str(n)]["ttft_p99"] or float("nan") for n in ns], style, label=labels[name])
    ax1.set(xlabel="concurrent clients", ylabel="aggregate output tok/s", title="throughput")
    ax2.set(xlabel="concurrent clients", ylabel="p99 TTFT (s)", title="time to first token (p99)", yscale="log")
    for ax in (ax1, ax2):
        ax.set_xticks(clients)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mxq", required=True, help="the mixqrt model (.mxq)")
    p.add_argument("--gguf", default=None, help="llama.cpp model; default: Q3_K_M made from --source")
    p.add_argument("--source", default=None, help="source GGUF (default: the Qwen test model, mixqrt.testing)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per point (all rounds)")
    p.add_argument("--rounds", type=int, default=1,
                   help="split each point's seconds into this many windows, run round-robin over all points")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--gemm-cache-bytes", type=int, default=None,
                   help="mixqrt serve --gemm-cache-bytes for the 'mixqrt' system (default: serve's own default)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=None,
                   help="context per slot (default 2048; shared-system: the system prompt + 608)")
    p.add_argument("--workload", choices=("mix", "shared-system"), default="mix",
                   help="mix: the chat mix with a short shared system prompt (docs/lab/serve-load.md); "
                        "shared-system: a --system-tokens system prompt shared by all, different questions "
                        "(docs/long-context.md)")
    p.add_argument("--system-tokens", type=int, default=4000)
    p.add_argument("--kv-type", default=None, help="mixqrt serve --kv-type (default: serve's)")
    p.add_argument("--np", type=int, default=8, help="llama-server's parallel slots (-np)")
    p.add_argument("--lookup", type=int, default=8, help="mixqrt-lookup: tokens drafted by prompt lookup")
    p.add_argument("--systems", default="mixqrt,llama-server",
                   help=f"comma-separated, of {', '.join(SYSTEMS)} (mixqrt-tiles: the GEMM tile cache on, 1 GiB)")
    p.add_argument("--log-dir", default="/tmp/serve_load")
    a = p.parse_args(argv)
    global CONVS
    if a.workload == "shared-system":
        from mixqrt.pipeline import LoadedModel
        lm = LoadedModel(a.mxq)
        CONVS = shared_system_conversations(long_system_prompt(lm.tokenizer, a.system_tokens))
        lm.close()
    if a.ctx is None:
        a.ctx = 2048 if a.workload == "mix" else a.system_tokens + 608
    systems = a.systems.split(",")
    if {"llamacpp", "llama-server", "llama-server-q8"} & set(systems) and a.gguf is None:
        if a.source is None:
            from mixqrt.testing import model_path
            a.source = str(model_path("qwen"))
        a.gguf = make_q3km(a.source, a.threads)
    a.gguf = a.gguf or "-"
    cmd = "python benchmarks/serve_load.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    info = machine_info()
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for name, extra in (("mixqrt", [] if a.gemm_cache_bytes is None else
                              ["--gemm-cache-bytes", str(a.gemm_cache_bytes)]),
                            ("mixqrt-lookup", ["--lookup", str(a.lookup)]),
                            ("mixqrt-tiles", ["--gemm-cache-bytes", str(TILES_BYTES)])):
            if name not in systems:
                continue
            port = free_port()
            servers[name] = ServerProc(name, [sys.executable, "-m", "mixqrt", "serve", a.mxq, "--port",
                                              str(port), "-t", str(a.threads), "--ctx", str(a.ctx), "-q",
                                              "--max-slots", str(a.max_slots)] + extra
                                       + (["--kv-type", a.kv_type] if a.kv_type else []),
                                       port, logs / f"{name}.log")
        for name, extra in (("llama-server", None), ("llama-server-q8", ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"])):
            if name in systems:
                port = free_port()
                servers[name] = ServerProc(name, llama_server_cmd(a.gguf, port, a.threads, a.ctx, a.np, extra), port,
                                           logs / f"{name}.log")
        if "llamacpp" in systems:
            port = free_port()
            servers["llamacpp"] = ServerProc("llamacpp", [sys.executable, "-m", "llama_cpp.server", "--model", a.gguf,
                                                          "--port", str(port), "--n_threads", str(a.threads),
                                                          "--n_threads_batch", str(a.threads), "--n_ctx", str(a.ctx),
                                                          # queue concurrent requests instead of cutting the
                                                          # running stream (its default)
                                                          "--interrupt_requests", "False"],
                                             port, logs / "llamacpp.log")
        for s in servers.values():
            s.wait_ready()
            run_load(s.url, 1, 3.0, 8)                          # warm-up: page in the weights
        recs = {name: {n: new_record() for n in a.clients} for name in servers}
        for rnd in range(a.rounds):          # every point once per round: slow drifts of a shared
            for n in a.clients:              # machine hit all points alike
                for name, s in servers.items():
                    load_window(s.url, n, a.seconds / a.rounds, a.max_tokens, recs[name][n])
                    print(f"round {rnd + 1}/{a.rounds} {name:9s} {n} clients: {recs[name][n]['rounds'][-1]:.1f} tok/s",
                          flush=True)
        res = {name: {} for name in servers}
        for n in a.clients:
            for name in servers:
                r = res[name][str(n)] = summarize(recs[name][n])
                print(f"{name:9s} {n} clients: {r['tok_s']:.1f} tok/s, TTFT p50 {_f(r['ttft_p50'], '{:.2f}')} "
                      f"p99 {_f(r['ttft_p99'], '{:.2f}')} s, ITL p50 {_f(r['itl_p50'], '{:.3f}')} s, "
                      f"{r['requests']} requests, {r['errors']} errors {r['error_kinds'] or ''}, cache hit "
                      f"{_f(r['cache_hit_rate'], '{:.2f}')}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    if a.workload == "shared-system":
        write_shared_system_report(res, a, info, cmd)
    else:
        write_report(res, a, info, cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
