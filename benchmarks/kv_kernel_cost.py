"""What one decode step's attention costs per KV type at depth, the kernels alone (issue 41): 24 layers'
caches of random K/V at N positions (larger than the L3 cache together, as a model streams them),
one query per layer in turn, the median time per step over a few seconds, per thread count.

    flock LOCKFILE python benchmarks/kv_kernel_cost.py --depths 4096,16384 --threads 1,2

The shape is Qwen2.5-Coder-0.5B's (2 KV heads x 7 query heads, head_dim 64, 24 layers). f32 / f16:
the float cache's C attention; q8 / q4: the packed cache's (mixqrt.kv). The table goes into
docs/long-context.md (mixqrt:long-context-kernel).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import provenance, update_doc  # noqa: E402
from long_context import DOC, loadavg  # noqa: E402

HKV, G, DH, LAYERS = 2, 7, 64, 24


def step_ms(kv: str, depth: int, threads: int, seconds: float) -> float:
    from mixqrt import ops
    from mixqrt.kv import ref
    from mixqrt.ops.pool import _ops
    ops.set_num_threads(threads)
    rng = np.random.default_rng(0)
    s = depth + 64
    k32 = rng.standard_normal((HKV, s, DH)).astype(np.float32)
    v32 = rng.standard_normal((HKV, s, DH)).astype(np.float32)
    q = rng.standard_normal((1, HKV * G, DH)).astype(np.float32)
    out = np.empty_like(q)
    if kv in ("q4", "q8"):
        bits = 4 if kv == "q4" else 8
        kf, vf = k32.astype(np.float16), v32.astype(np.float16)
        layers = []
        for _ in range(LAYERS):
            pk = np.zeros((HKV, s // 64, ref.block_bytes(DH, bits)), np.uint8)
            _ops.kv_pack(kf, vf, 1, depth // 64, bits, pk)
            layers.append(pk)
        call = lambda pk: _ops.kv_attention(q, kf, vf, pk, depth - 1, bits, 0, out, threads)   # noqa: E731
    else:
        dt = np.float32 if kv == "f32" else np.float16
        layers = [(k32.astype(dt), v32.astype(dt)) for _ in range(LAYERS)]
        call = lambda kv_: ops.attention(q, kv_[0], kv_[1], depth - 1, out)                   # noqa: E731
    ts, end = [], time.time() + seconds
    while time.time() < end or len(ts) < 5:
        t = time.perf_counter()
        for x in layers:
            call(x)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="4096,16384")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--kv-types", default="f32,f16,q8,q4")
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()
    depths = [int(x) for x in a.depths.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    kvs = a.kv_types.split(",")
    before = loadavg()
    res = {}
    for d in depths:
        for t in threads:
            for kv in kvs:
                res[d, t, kv] = step_ms(kv, d, t, a.seconds)
                print(f"depth {d} threads {t} {kv}: {res[d, t, kv]:.2f} ms per step (24 layers)", flush=True)
    after = loadavg()
    rows = ["| keys | threads | " + " | ".join(kvs) + " |", "|---:|---:|" + "---:|" * len(kvs)]
    for d in depths:
        for t in threads:
            rows.append(f"| {d:,d} | {t} | " + " | ".join(f"{res[d, t, kv]:.2f} ms" for kv in kvs) + " |")
    prov = provenance("python benchmarks/kv_kernel_cost.py " + " ".join(sys.argv[1:]))
    prov += (f"- one decode step's attention over 24 layers (2 KV x 7 query heads, Dh 64), median; "
             f"load {before.split()[0]} before, {after.split()[0]} after\n")
    update_doc(DOC, {"long-context-kernel": prov + "\n" + "\n".join(rows)}, "Long context")


if __name__ == "__main__":
    main()
