"""Editor trace: completion latency at the keystroke, mixqrt serve against llama-server, the same GGUF,
side by side in one run (requests alternate between the two servers).

The trace: a 2,000-token Python file (the start of the stdlib's textwrap.py, cut to 2,000 tokens of the
model's tokenizer); the cursor sits before its last 30 tokens, which are the suffix of every request.
A user types a new line at the cursor, a few characters per request (TYPED, 3 characters at a time),
and each keystroke sends POST /infill {input_prefix: the file up to the cursor, input_suffix: the 30
tokens after it, n_predict: 16, temperature: 0, cache_prompt: true, stream: true}: 20 requests. Time to
first token is the time to the first streamed piece with text, total the time to the last event,
both measured at the client. llama-server runs with --cache-reuse 256 (llama.vim's recommendation), 2
threads, a 4,096-token context; mixqrt serve with 2 threads and its defaults (the prompt cache on).

    MIXQRT_LLAMA_CPP_BIN=/work/llama/build/bin flock /work/bench.lock python benchmarks/editor_trace.py \\
        --gguf ~/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --json docs/data/editor-trace.json

mixqrt serves the GGUF quantized with its default recipe (q4a, cached in ~/.cache/mixqrt); llama-server
serves the GGUF itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FILE_TOKENS, SUFFIX_TOKENS, REQUESTS, STEP = 2000, 30, 20, 3
TYPED = "        lines = [line.rstrip() for line in text.splitlines() if line.strip()]\n        return lines\n"
N_PREDICT = 16


def trace(tokenizer) -> list[tuple[str, str]]:
    """[(prefix, suffix)] of the 20 requests."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")
    ids = tokenizer.encode(src, parse_special=False)[:FILE_TOKENS]
    text = tokenizer.decode(ids)
    tail = tokenizer.decode(ids[FILE_TOKENS - SUFFIX_TOKENS:])
    head = text[:len(text) - len(tail)]
    cut = head.rfind("\n") + 1                  # the cursor at the start of the line before the suffix
    prefix0, suffix = head[:cut], head[cut:] + tail
    return [(prefix0 + TYPED[:STEP * (i + 1)], suffix) for i in range(REQUESTS)]


def infill(url: str, prefix: str, suffix: str) -> dict:
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": N_PREDICT, "temperature": 0.0,
            "top_k": 1, "cache_prompt": True, "stream": True}
    req = urllib.request.Request(url + "/infill", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, last = None, "", None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("content") and not ev.get("stop") and ttft is None:
                ttft = time.perf_counter() - t0
            if not ev.get("stop"):
                text += ev.get("content", "")
            else:
                last = ev
    total = time.perf_counter() - t0
    timings = (last or {}).get("timings", {})
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "text": text,
            "prompt_n": timings.get("prompt_n"), "cache_n": timings.get("cache_n")}


def start_mixqrt(gguf: str, threads: int, log_dir: Path):
    from _llama_server import ServerProc, free_port
    port = free_port()
    cmd = [sys.executable, "-m", "mixqrt", "serve", gguf, "--port", str(port), "-t", str(threads), "-q",
           "--ctx", "4096"]
    return ServerProc("mixqrt", cmd, port, log_dir / "mixqrt.log")


def summary(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))],
            "min": xs[0], "max": xs[-1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--cache-reuse", type=int, default=256)
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default="/tmp/editor-trace-logs")
    a = ap.parse_args(argv)
    from _llama_server import start_llama_server
    from mixqrt.io import open_source

    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open_source(a.gguf) as src:
        tok = src.tokenizer
    reqs = trace(tok)
    print(f"trace: file {FILE_TOKENS} tokens, suffix {len(tok.encode(reqs[0][1], parse_special=False))} tokens, "
          f"{len(reqs)} requests typing {STEP} characters each", flush=True)
    subprocess.run([sys.executable, "-m", "mixqrt", "generate", a.gguf, "-p", "x", "-n", "1", "-q"],
                   check=True, capture_output=True)          # the q4a file exists before timing starts
    servers = {"mixqrt": start_mixqrt(a.gguf, a.threads, log_dir),
               "llama-server": start_llama_server("llama-server", a.gguf, a.threads, 4096, log_dir,
                                                  extra=["--cache-reuse", str(a.cache_reuse)])}
    try:
        for s in servers.values():
            s.wait_ready()
        load0 = os.getloadavg()
        rows = {name: [] for name in servers}
        for i, (prefix, suffix) in enumerate(reqs):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))    # alternate who goes first
            for name in order:
                r = infill(servers[name].url, prefix, suffix)
                rows[name].append(r)
                print(f"{i:2d} {name:12s} ttft {1000 * r['ttft_s']:7.1f} ms  total {1000 * r['total_s']:7.1f} ms  "
                      f"prompt_n {r['prompt_n']}  cache_n {r['cache_n']}  {r['text'][:30]!r}", flush=True)
        load1 = os.getloadavg()
    finally:
        for s in servers.values():
            s.stop()
    out = {name: {"ttft": summary([r["ttft_s"] for r in rs]), "total": summary([r["total_s"] for r in rs]),
                  "requests": rs} for name, rs in rows.items()}
    m, l_ = out["mixqrt"]["ttft"]["median"], out["llama-server"]["ttft"]["median"]
    for name, o in out.items():
        print(f"{name:12s} TTFT median {1000 * o['ttft']['median']:7.1f} ms  p90 {1000 * o['ttft']['p90']:7.1f} ms | "
              f"total median {1000 * o['total']['median']:7.1f} ms  p90 {1000 * o['total']['p90']:7.1f} ms")
    print(f"TTFT median ratio mixqrt / llama-server = {m / l_:.2f}; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    if a.json:
        from mixqrt.io.atomic import atomic_write
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gguf": Path(a.gguf).name,
               "threads": a.threads, "cache_reuse": a.cache_reuse, "n_predict": N_PREDICT, "file_tokens": FILE_TOKENS,
               "suffix_tokens": SUFFIX_TOKENS, "step_chars": STEP, "load_before": load0, "load_after": load1,
               "ttft_median_ratio": m / l_, "systems": out}
        with atomic_write(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
