"""Decode speed of several .mxq files, alternated round by round in one process (2356 vs a re-quantization).

    flock /work/bench.lock python benchmarks/decode_files_ab.py A.mxq B.mxq [...] [--threads 2]
                                                                [--tokens 32] [--rounds 6] [--json OUT]

Each round and file: the cache is trimmed back to the end of a 64-token prompt, then `tokens` greedy
single-token steps are timed. Files are alternated A, B, A, B... so machine noise hits them alike;
reported per file: best and median round (tok/s) and their ratio to the first file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import mixqrt
    from mixqrt import ops
    ops.set_num_threads(a.threads)
    prompt = np.random.default_rng(0).integers(100, 30000, size=64)
    runs = []
    for path in a.models:
        m = mixqrt.load(path).model
        cache = m.make_cache(64 + a.tokens + 8)
        m(prompt, cache, 0, last_only=True)
        runs.append((path, m, cache, []))
    for _ in range(a.rounds):
        for path, m, cache, rates in runs:
            cache.trim(cache.offset - 64)
            tok = 1000
            t = time.perf_counter()
            for _ in range(a.tokens):
                tok = int(np.argmax(m(np.array([tok]), cache, None, last_only=True)))
            rates.append(a.tokens / (time.perf_counter() - t))
            print(f"{os.path.basename(path)}: {rates[-1]:.2f} tok/s", flush=True)
    ref_best, ref_med = max(runs[0][3]), statistics.median(runs[0][3])
    out = []
    for path, _, _, rates in runs:
        best, med = max(rates), statistics.median(rates)
        out.append({"model": path, "bytes": os.path.getsize(path), "best": best, "median": med,
                    "best_ratio": best / ref_best, "median_ratio": med / ref_med, "rounds": rates})
        print(f"{os.path.basename(path):24s} best {best:6.2f}  median {med:6.2f} tok/s  "
              f"ratio best {best / ref_best:.3f} median {med / ref_med:.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "tokens": a.tokens, "rounds": a.rounds, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
