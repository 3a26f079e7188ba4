"""Speed of one build of mixqrt, for an A/B of two builds alternated process by process
(docs/lab/refactor-ab.md). Prints one JSON line; the figures are the best (minimum time) over
batches, which other work on a shared machine disturbs less than a median.

  products MODEL? : ops.matmul of q4x / q6x weights at the q4a Qwen2.5-Coder-0.5B shapes, T = 1, 4, 128
                    (microseconds per call; the weights stay in cache: the kernels' code, not memory)
  model MODEL     : a 256-token prompt (tok/s) and decode steps (tok/s) of the whole model, f32 KV cache

Uses only what every build since 2026-12-03 has (mixqrt.load, ops.matmul, formats.codec), so the same
file times an old checkout: `cd OLD && PYTHONPATH=. python /path/to/refactor_ab.py model M`.
Run it under the shared lock: `flock /work/bench.lock ...`."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from _common import best_time   # benchmarks/ (the script's folder) is on sys.path


def _best(fn, batches=7, seconds=0.02):
    """Seconds per call, best of `batches` batches of about `seconds` each."""
    fn()
    t = time.perf_counter()
    fn()
    return best_time(fn, max(1, int(seconds / max(1e-6, time.perf_counter() - t))), batches)


def products() -> dict:
    from mixqrt import ops
    from mixqrt.formats import codec
    rng = np.random.default_rng(0)
    out = {}
    for fmt, n, k in (("q4", 9728, 896), ("q4", 896, 4864), ("q6", 1152, 896)):   # gate_up, down, qkv
        w = codec.to_storage(codec.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, fmt))
        for t in (1, 4, 128):
            x = rng.standard_normal((t, k) if t > 1 else k).astype(np.float32)
            out[f"{w.fmt} {n}x{k} T={t} us"] = _best(lambda: ops.matmul(w, x)) * 1e6
    return out


def model(path: str, threads: int = 2) -> dict:
    import mixqrt
    from mixqrt import ops
    m = mixqrt.load(path).model
    if hasattr(ops, "set_num_threads"):
        ops.set_num_threads(threads)
    try:
        cache = m.make_cache(600, "f32")
    except TypeError:                      # a build before the KV cache types: f32 only
        cache = m.make_cache(600)
    prompt = np.random.default_rng(0).integers(100, 30000, size=256)
    m(prompt[:32], cache, 0, last_only=True)
    pp, tg = [], []
    for _ in range(5):
        cache.reset()
        t = time.perf_counter()
        tok = int(np.argmax(m(prompt, cache, 0, last_only=True)))
        pp.append(time.perf_counter() - t)
        for _ in range(4):
            t = time.perf_counter()
            for _ in range(16):
                tok = int(np.argmax(m(np.array([tok]), cache, None, last_only=True)))
            tg.append((time.perf_counter() - t) / 16)
    return {"pp256 tok/s": 256 / min(pp), "tg tok/s": 1 / min(tg)}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("products", "model") or (sys.argv[1] == "model" and len(sys.argv) < 3):
        sys.exit(__doc__)
    print(json.dumps(products() if sys.argv[1] == "products" else model(sys.argv[2])))
