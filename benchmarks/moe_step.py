"""One decode step of a model file by part: wall and CPU time, page faults, per-product GB/s.

    python benchmarks/moe_step.py /tmp/mixqrt-moe/moe-l4-v151936-2356t.mxq
    flock /work/bench.lock python benchmarks/moe_step.py FILE --threads 1,2 --prompt 512 --steps 24

For each thread count: the mean decode step after a --prompt token prefill (greedy tokens fed back,
so a MoE model's experts change from step to step), its wall time, its process CPU time (user and
system: all pool threads), minor/major page faults per step; then the same steps op by op
(ops.FUSED_DECODE off) with every ops.matmul timed (wall), grouped by format and shape, with the bytes
each reads. CPU time is the gauge to compare on a shared machine: a wall time only means something
while no other job runs (take the shared bench lock). A step whose CPU time is near threads x wall
and whose wall is near the 1-thread CPU time / threads scales; one whose wall exceeds the 1-thread
wall is waiting for a core another job holds.
"""
from __future__ import annotations

import argparse
import collections
import resource
import time

import numpy as np


def _usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_majflt])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens before the decode steps")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    a = ap.parse_args(argv)

    from mixqrt import ops
    from mixqrt.pipeline import LoadedModel
    lm = LoadedModel(a.model)
    m = lm.model
    for nt in [int(t) for t in a.threads.split(",")]:
        ops.set_num_threads(nt)
        cache = m.make_cache(a.prompt + 4 * a.steps + 8)
        prompt = np.random.default_rng(0).integers(100, min(30000, m.args.vocab_size), size=a.prompt)
        tok = int(np.argmax(m(prompt, cache, 0, last_only=True)))

        def steps(n):
            nonlocal tok
            for _ in range(n):
                tok = int(np.argmax(m(np.array([tok]), cache, None, last_only=True)))

        steps(2)
        u0 = _usage()
        steps(a.steps)
        d = (_usage() - u0) / a.steps
        print(f"threads {nt}: step {d[0] * 1e3:.1f} ms wall ({1 / d[0]:.1f} tok/s), CPU user {d[1] * 1e3:.1f} "
              f"+ system {d[2] * 1e3:.1f} ms, page faults {d[3]:.1f} minor {d[4]:.1f} major", flush=True)

        orig, acc = ops.matmul, collections.defaultdict(lambda: [0.0, 0, 0])

        def timed(w, x, out=None, then=None, silu=False):
            t = time.perf_counter()
            y = orig(w, x, out, then, silu)
            r = acc[(getattr(w, "fmt", "f32"), tuple(np.shape(w)))]
            r[0] += time.perf_counter() - t
            r[1] += 1
            r[2] += int(getattr(w, "nbytes", 0))
            return y

        fused, ops.matmul, ops.FUSED_DECODE = ops.FUSED_DECODE, timed, False
        try:
            t0 = time.perf_counter()
            steps(a.steps)
            wall = (time.perf_counter() - t0) / a.steps
        finally:
            ops.matmul, ops.FUSED_DECODE = orig, fused
        tot = sum(r[0] for r in acc.values()) / a.steps
        print(f"  op by op: step {wall * 1e3:.1f} ms wall, products {tot * 1e3:.1f} ms")
        print("  | format | shape | products/step | ms/step | MB/step | GB/s |")
        for (fmt, shape), (t, n, nb) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
            print(f"  | {fmt} | {shape} | {n / a.steps:.0f} | {t / a.steps * 1e3:.2f} | {nb / a.steps / 1e6:.1f} "
                  f"| {nb / max(t, 1e-9) / 1e9:.1f} |")
    lm.close()


if __name__ == "__main__":
    main()
