"""Cost of one batched decode step (Model.decode_batch) against one single-sequence step.

    python benchmarks/decode_batch.py MODEL.mxq [--threads 2] [--steps 12] [--gemm-min-t 8,16,64]
        [--few-t 1,0]

Each sequence first gets a 64-token prompt; then `steps` decode steps are timed for B = 1 (the
single-sequence path), 4 and 8, per setting, alternated twice: the GEMM threshold of the row
formats (T >= threshold takes the tile-unpacking GEMM) and the few-row products of the interleaved
formats (`_ops.set_few_t`: 1 = 2-8 rows through the decode unpack, 0 = through the GEMM). Prints ms
per step and the throughput gain B * t(1) / t(B). docs/lab/serve-load.md uses it to explain the engine's
scaling from 1 to 8 clients.
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
    ap.add_argument("--gemm-min-t", default="8,16,64")
    ap.add_argument("--few-t", default="1,0", help="few-row products on/off to compare (1, 0 or both)")
    args = ap.parse_args()
    import mixqrt
    from mixqrt._kernels import _ops
    model = mixqrt.load(args.model, threads=args.threads, progress=False).model
    settings = [(g, f) for g in [int(v) for v in args.gemm_min_t.split(",")]
                for f in [v.strip() == "1" for v in args.few_t.split(",")]]
    for g, f in settings * 2:
        _ops.set_gemm_min_t(g)
        _ops.set_few_t(f)
        r1, r4, r8 = (step_time(model, b, args.steps) for b in (1, 4, 8))
        print(f"gemm_min_t={g} few_t={int(f)}: B=1 {r1 * 1e3:.1f} ms, B=4 {r4 * 1e3:.1f} ms "
              f"({4 * r1 / r4:.2f}x), B=8 {r8 * 1e3:.1f} ms ({8 * r1 / r8:.2f}x)", flush=True)
    _ops.set_gemm_min_t(8)
    _ops.set_few_t(True)


if __name__ == "__main__":
    main()
