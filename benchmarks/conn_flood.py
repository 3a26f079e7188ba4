"""Connection flood from many addresses (issue 39, item 4): how long does a real request from a
new address wait for its answer while 500 half-sent requests from 10 addresses keep reopening?

    flock /work/bench.lock python benchmarks/conn_flood.py                       # this checkout
    flock /work/bench.lock python benchmarks/conn_flood.py --src /path/to/other  # e.g. main before

Starts a server (the tests' tiny model, f32, uvicorn through mixqrt.serving.server.cli.uvicorn_config:
the server's own limits) in a child process running the mixqrt of --src, floods it with
mixqrt.testing.flood (--flood half-sent requests from --addresses loopback addresses, each
reopened as soon as the server closes it), then sends --requests real requests one after another,
each from a new address, each retried on a 503 or a refused connection as a client honouring
Retry-After would (after 1 s) until a 200 or --give-up seconds. Prints one JSON line: first-try
statuses, and the time to a 200 (p50, p99, max; requests never served count as --give-up).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
os.environ["MIXQRT_CACHE"] = os.path.join(sys.argv[2], "cache")
import uvicorn
from mixqrt.pipeline import Pipeline
from mixqrt.serving.server.app import create_app
from mixqrt.serving.server.cli import uvicorn_config
from mixqrt.testing.tiny import make_tiny_hf_model
pipe = Pipeline(make_tiny_hf_model(os.path.join(sys.argv[2], "hf")), recipe="f32", progress=False, offline=True,
                max_context=256)
app = create_app(pipe, model="tiny")
server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)
print("PORT", server.servers[0].sockets[0].getsockname()[1], flush=True)
sys.stdin.read()
server.should_exit = True
"""


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(argv=None) -> dict:
    from mixqrt.testing.flood import Flood, loopback, real_request
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(ROOT), help="the checkout whose mixqrt serves (default: this one)")
    ap.add_argument("--flood", type=int, default=500)
    ap.add_argument("--addresses", type=int, default=10)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--give-up", type=float, default=30.0)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mixqrt-conn-flood-") as d:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, a.src, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            port = int(proc.stdout.readline().split()[1])
            first, waits = Counter(), []
            with Flood(port, n=a.flood, addresses=a.addresses) as f:
                time.sleep(1.0)
                for i in range(a.requests):
                    src = loopback(a.addresses + 5 + i)
                    t0, status = time.perf_counter(), None
                    tries = 0
                    while True:
                        status, _ = real_request(port, src, timeout=a.give_up)
                        tries += 1
                        if tries == 1:
                            first[status] += 1
                        if status == 200 or time.perf_counter() - t0 > a.give_up:
                            break
                        time.sleep(1.0)             # Retry-After: 1
                    waits.append(time.perf_counter() - t0 if status == 200 else a.give_up)
                held, reopened = f.opened, f.closed_by_server
        finally:
            proc.stdin.close()
            proc.wait(30)
    out = {"src": a.src, "flood": a.flood, "addresses": a.addresses, "requests": a.requests,
           "first_try": {str(k): v for k, v in first.items()}, "served": sum(w < a.give_up for w in waits),
           "p50_s": round(percentile(waits, 50), 4), "p99_s": round(percentile(waits, 99), 4),
           "max_s": round(max(waits), 4), "flood_opened": held, "flood_closed_by_server": reopened,
           "load": os.getloadavg()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
