"""Cost of one batched decode step (Model.decode_batch) against one single-sequence step.

    python benchmarks/decode_batch.py MODEL.mxq [--threads 2] [--steps 12] [--batches 1,2,4,6,8]
        [--rounds 2] [--gemm-min-t 18] [--few-t 1,0]

Each sequence first gets a 64-token prompt; then `steps` decode steps are timed for each B of
--batches (B = 1: the single-sequence path), per setting, alternated --rounds times in one process:
the GEMM threshold of the row formats (T >= threshold takes the tile-unpacking GEMM; below it every
row is the T = 1 row; the interleaved formats' 2-8 rows always take the few-row products since
MIXQRT_FEW_T was retired, docs/kernels.md). Prints ms per step, the cost of a step
against a single step t(B) / t(1) and the throughput gain B * t(1) / t(B). docs/lab/serve-load.md
uses it to explain the engine's scaling from 1 to 8 clients.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def step_time(model, b: int, steps: int) -> float:
    caches = [model.make_cache(512) for _ in range(b)]
    for c in caches:
        model(np.arange(1, 65), c, 0, last_only=True)
    toks = [5] * b
    t = time.perf_counter()
    for _ in range(steps):
        if b == 1:
            model(np.array([5]), caches[0], last_only=True)
        else:
            model.decode_batch(toks, caches)
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gemm-min-t", default="18")
    ap.add_argument("--batches", default="1,4,8", help="batch sizes B to time (1 is the reference)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import mixqrt
    from mixqrt._kernels import _ops
    model = mixqrt.load(args.model, threads=args.threads, progress=False).model
    settings = [int(v) for v in args.gemm_min_t.split(",")]
    batches = sorted({1} | {int(v) for v in args.batches.split(",")})
    for g in settings * args.rounds:
        old_g = _ops.set_gemm_min_t(g)
        r = {b: step_time(model, b, args.steps) for b in batches}
        print(f"gemm_min_t={g}: " + ", ".join(
            f"B={b} {r[b] * 1e3:.1f} ms" + ("" if b == 1 else f" ({r[b] / r[1]:.2f}x a step, {b * r[1] / r[b]:.2f}x tok/s)")
            for b in batches), flush=True)
        _ops.set_gemm_min_t(old_g)


if __name__ == "__main__":
    main()
