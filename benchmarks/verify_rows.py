"""Cost of a speculative verify of T rows of one sequence against one decode step and the GEMM.

    python benchmarks/verify_rows.py MODEL.mxq [--threads 2] [--rows 1,2,4,8,9,16,17,24,32,48,64,65]
        [--context 600] [--rounds 3] [--reps 4] [--gemm-cache-bytes N] [--few-max-t 64,0]

One sequence holds a --context-token prompt; then, per T of --rows, a forward of T rows at its next
positions is timed and the KV cache trimmed back (as Engine._step_speculative does): the body
(Model.forward_hidden, every layer on T rows), the head on all T rows and the head on the first 8
rows only (the engine computes the logits of a long verify in pieces and stops at the first
rejected draft). T = 1 is the plain decode step (`model(.., last_only=True)`, the fused layers).
The GEMM's asymptote: a 512-row prompt chunk, per row. --few-max-t compares settings of
_ops.set_few_max_t (9..t rows of q4x / q6x / q3x through the few-row kernels over L2 row blocks; 0: the
VNNI GEMM). Rounds alternate the T's and the settings in one process. Prints ms per forward, the cost
against one step and ms per row, per setting.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def timed(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,9,16,17,24,32,48,64,65")
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--few-max-t", default="64", help="settings of _ops.set_few_max_t to compare")
    ap.add_argument("--gemm-cache-bytes", type=int, default=0, help="ops.set_gemm_cache: the GEMM reads cached "
                    "unpacked tiles instead of unpacking (0: off, the default)")
    args = ap.parse_args()
    import os

    import mixqrt
    from mixqrt import ops
    model = mixqrt.load(args.model, threads=args.threads, progress=False).model
    ops.set_gemm_cache(args.gemm_cache_bytes)
    rows = [int(v) for v in args.rows.split(",")]
    cache = model.make_cache(args.context + max(rows) + 600)
    rng = np.random.default_rng(0)
    model(rng.integers(100, 20000, args.context), cache, 0, last_only=True)
    base = cache.offset

    def body(t):
        ids = rng.integers(100, 20000, t)
        if t == 1:
            model(ids, cache, last_only=True)
        else:
            model.forward_hidden(ids, cache, base)
        cache.trim(cache.offset - base)

    h = {t: rng.standard_normal((t, model.args.hidden_size)).astype(np.float32) for t in rows}
    from mixqrt._kernels import _ops
    few = [int(v) for v in args.few_max_t.split(",")]
    res = {(f, t): {"body": [], "head": [], "head8": []} for f in few for t in rows}
    for _ in range(args.rounds):
        for f in few:
            old = _ops.set_few_max_t(f)
            for t in rows:
                r = res[(f, t)]
                r["body"].append(timed(lambda: body(t), args.reps))
                if t > 1:
                    r["head"].append(timed(lambda: model.head(h[t]), args.reps))
                    r["head8"].append(timed(lambda: model.head(h[t][:8]), args.reps))
            _ops.set_few_max_t(old)
    chunk = rng.integers(100, 20000, 512)
    c2 = model.make_cache(600)
    gemm = statistics.median(timed(lambda: (model.forward_hidden(chunk, c2, 0), c2.trim(c2.offset)), 1)
                             for _ in range(2)) / 512
    one = statistics.median(x for f in few for x in res[(f, 1)]["body"])
    print(f"load {os.getloadavg()[0]:.2f}; one step {one * 1e3:.2f} ms; the GEMM (512-row prompt chunk, body) "
          f"{gemm * 1e3:.3f} ms a row")
    print("| few_max_t | rows | body ms | body / step | body ms a row | head ms (all rows) | head ms (8 rows) | "
          "verify (body + 8-row head) / step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in few:
        for t in rows:
            b = statistics.median(res[(f, t)]["body"])
            if t == 1:
                print(f"| {f} | 1 | {b * 1e3:.1f} | 1.00x | {b * 1e3:.2f} | (in the step) | | 1.00x |")
                continue
            hd, h8 = statistics.median(res[(f, t)]["head"]), statistics.median(res[(f, t)]["head8"])
            print(f"| {f} | {t} | {b * 1e3:.1f} | {b / one:.2f}x | {b / t * 1e3:.2f} | {hd * 1e3:.1f} | "
                  f"{h8 * 1e3:.1f} | {(b + h8) / one:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
