"""Prompt-cache flood: does `--kv-cache-bytes` bound the server's memory, and does throughput hold?

    python benchmarks/cache_flood.py                       # tiny model, 50 MiB bound, 20k requests
    python benchmarks/cache_flood.py --quick               # 2k requests, no docs written
    python benchmarks/cache_flood.py --mixqrt-root /work/wt/base --no-docs   # an older checkout

Starts `python -m mixqrt serve` on a .mxq of the tests' tiny model (tests/tinymodel.py; or --model)
with `--kv-cache-bytes` (default 50 MiB), then from --clients threads with keep-alive connections:
--warmup requests; --measure distinct short completions (req/s "before"); the flood of --flood
distinct short completions (each prompt differs from the others, so each leaves its own cache
entry behind); --measure more (req/s "after"). The server's RSS (/proc/PID/status) is sampled
through the flood. Pass: peak RSS <= 1.3 x (model file + bound + FIXED_OVERHEAD) and throughput
after >= 0.8 x before. Writes the table between the `mixqrt:server-cache-flood` markers of
docs/server.md and docs/data/server-cache-flood.json.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import machine_info, update_doc, write_json  # noqa: E402

MiB = 1 << 20
# What a started server holds besides the model and the KV bound: Python, numpy, the HTTP stack,
# prometheus-client and the kernels: 58 MiB at start with the tiny model (docs/server.md).
FIXED_OVERHEAD = 64 * MiB


def rss(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list, root: str, tmp: Path) -> tuple[subprocess.Popen, int]:
    """`python -m mixqrt serve ARGS --port P` from checkout `root` -> (process, port) once it listens."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": root, "MIXQRT_CACHE": str(tmp / "cache")}
    env.pop("MIXQRT_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "mixqrt", "serve", *args, "--port", str(port), "-q", "--offline"],
                            env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"server did not start: {proc.stderr.read().decode()[-2000:]}") from None
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def tiny_mxq(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodel import make_tiny_hf_model

    from mixqrt.quantize.convert import quantize_model
    out = folder / "tiny-f32.mxq"
    quantize_model(str(make_tiny_hf_model(folder / "hf")), "f32", out, progress=False)
    return out


class Load:
    """--clients threads, each with its own keep-alive connection, sending the prompts of a range."""

    def __init__(self, port: int, clients: int, max_tokens: int):
        self.port, self.clients, self.max_tokens = port, clients, max_tokens
        self.errors = 0
        self.cached = 0

    def run(self, prompts: list[str]) -> float:
        """Send every prompt once -> requests per second."""
        nxt = iter(range(len(prompts)))
        lock = threading.Lock()

        def worker():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    break
                body = json.dumps({"prompt": prompts[i], "max_tokens": self.max_tokens, "temperature": 0})
                for attempt in range(50):
                    try:
                        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                        r = conn.getresponse()
                        data = r.read()
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                        continue
                    if r.status == 503:
                        time.sleep(0.05)
                        continue
                    if r.status != 200:
                        with lock:
                            self.errors += 1
                    else:
                        u = json.loads(data).get("usage", {})
                        with lock:
                            self.cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    break
            conn.close()

        t = time.perf_counter()
        ths = [threading.Thread(target=worker, daemon=True) for _ in range(self.clients)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return len(prompts) / (time.perf_counter() - t)


def prompts(start: int, n: int) -> list[str]:
    # distinct from the first characters on: each request is its own cache entry
    return [f"{i:06d} flood {i % 97}" for i in range(start, start + n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .mxq (default: the tests' tiny model, made here)")
    ap.add_argument("--kv-cache-bytes", type=int, default=50 * MiB)
    ap.add_argument("--flood", type=int, default=20000)
    ap.add_argument("--measure", type=int, default=1000, help="requests timed before and after the flood")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mixqrt-root", default=str(ROOT), help="the checkout the server runs (PYTHONPATH)")
    ap.add_argument("--quick", action="store_true", help="2k flood, 300 measured; no docs written")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "data" / "server-cache-flood.json"))
    a = ap.parse_args()
    if a.quick:
        a.flood, a.measure, a.no_docs = 2000, 300, True
    tmp = Path(tempfile.mkdtemp(prefix="cache-flood-"))
    model = Path(a.model) if a.model else tiny_mxq(tmp)
    srv, port = start_server([str(model), "-t", str(a.threads), "--kv-cache-bytes", str(a.kv_cache_bytes),
                              "--max-queue", "256"], a.mixqrt_root, tmp)
    try:
        rss_start = rss(srv.pid)
        load = Load(port, a.clients, a.max_tokens)
        load.run([f"warm {i}" for i in range(a.warmup)])
        rss_warm = rss(srv.pid)
        before = load.run(prompts(0, a.measure))
        samples, step, done = [], max(1, a.flood // 20), 0
        t0 = time.perf_counter()
        while done < a.flood:
            n = min(step, a.flood - done)
            load.run(prompts(10 ** 5 + done, n))
            done += n
            samples.append((done, rss(srv.pid)))
            print(f"flood {done}/{a.flood}: RSS {samples[-1][1] / MiB:.1f} MiB", flush=True)
        flood_rate = a.flood / (time.perf_counter() - t0)
        after = load.run(prompts(5 * 10 ** 5, a.measure))
        rss_end, rss_peak = rss(srv.pid), rss(srv.pid, "VmHWM")
    finally:
        stop_server(srv)
    model_bytes = model.stat().st_size
    limit = 1.3 * (model_bytes + a.kv_cache_bytes + FIXED_OVERHEAD)
    res = {"machine": machine_info(), "command": " ".join(["python"] + sys.argv), "model": str(model.name),
           "model_bytes": model_bytes, "kv_cache_bytes": a.kv_cache_bytes, "fixed_overhead": FIXED_OVERHEAD,
           "flood": a.flood, "clients": a.clients, "max_tokens": a.max_tokens, "threads": a.threads,
           "mixqrt_root": a.mixqrt_root, "rss_start": rss_start, "rss_warm": rss_warm, "rss_end": rss_end,
           "rss_peak": rss_peak, "rss_limit": limit, "rss_samples": samples, "req_s_before": before,
           "req_s_after": after, "req_s_flood": flood_rate, "errors": load.errors,
           "rss_ok": rss_peak <= limit, "throughput_ok": after >= 0.8 * before}
    print(json.dumps({k: v for k, v in res.items() if k not in ("machine", "rss_samples")}, indent=1))
    if not a.no_docs:
        write_json(a.out, res)
        write_doc(res)
    return 0 if res["rss_ok"] and res["throughput_ok"] and not load.errors else 1


def write_doc(r: dict) -> None:
    m = r["machine"]
    lines = [f"{m.get('cpu_model')}, {r['threads']} kernel threads, {m['date_utc']}, commit {m['git_commit']}, "
             f"load average {m['loadavg'][0]:.1f} at the end. Model `{r['model']}` ({r['model_bytes'] / MiB:.2f} MiB). "
             f"Command: `{r['command']}`. {r['flood']:,} distinct completions of 4 tokens from "
             f"{r['clients']} keep-alive clients.", "",
             "| | value |", "|---|---:|",
             f"| `--kv-cache-bytes` | {r['kv_cache_bytes'] / MiB:.0f} MiB |",
             f"| server RSS at start / after warm-up | {r['rss_start'] / MiB:.1f} / {r['rss_warm'] / MiB:.1f} MiB |",
             f"| server RSS after the flood / peak | {r['rss_end'] / MiB:.1f} / {r['rss_peak'] / MiB:.1f} MiB |",
             f"| limit 1.3 x (model + bound + {r['fixed_overhead'] / MiB:.0f} MiB) | {r['rss_limit'] / MiB:.1f} MiB |",
             f"| growth over warm-up / bound | {(r['rss_peak'] - r['rss_warm']) / r['kv_cache_bytes']:.2f}x |",
             f"| req/s before / during / after the flood | {r['req_s_before']:.0f} / {r['req_s_flood']:.0f} / "
             f"{r['req_s_after']:.0f} ({r['req_s_after'] / r['req_s_before']:.2f}x) |",
             f"| errors | {r['errors']} |"]
    update_doc(ROOT / "docs" / "server.md", {"server-cache-flood": "\n".join(lines)})


if __name__ == "__main__":
    sys.exit(main())
