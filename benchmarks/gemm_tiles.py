"""The GEMM tile cache (ops.set_gemm_cache): batched products and decode steps with and without it.

    flock /work/bench.lock python benchmarks/gemm_tiles.py MODEL.mxq [--rounds 3] [--no-doc]

Thread CPU time (`time.thread_time`, products on the calling thread only: `ops.local_threads(1)`,
numpy's BLAS held to one thread by the started pool), so other jobs on a shared machine change the
numbers less than wall time would. Two tables, both best of `rounds` alternated rounds (off, on,
off, on ...):
  - per product: layer 0's fused q/k/v, o_proj, fused gate/up, down_proj and lm_head, at T = 2, 4,
    8, 16 rows, unpacking (no cache) against the cached tiles; the cached result is checked to be
    bit-identical where both take the GEMM (T >= the GEMM threshold);
  - per decode step (Model.decode_batch after a 64-token prompt per sequence; B = 1 is the plain
    single-sequence step, which never reads tiles): CPU ms per step and B x t(1) / t(B).
Writes both into docs/lab/kernels-gemm.md (block `gemm-tiles`) unless --no-doc.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ROOT, best_time, machine_info, update_doc  # noqa: E402

TS = (2, 4, 8, 16)
BS = (1, 2, 4, 8, 16)


def cpu_ms(fn, reps: int, tries: int = 5) -> float:
    return best_time(fn, reps, tries, time.thread_time) * 1e3   # CPU time of this thread


def step_ms(model, b: int) -> float:
    caches = [model.make_cache(512) for _ in range(b)]
    for c in caches:
        model(np.arange(1, 65), c, 0, last_only=True)

    def one():
        if b == 1:
            model(np.array([5]), caches[0], last_only=True)
        else:
            model.decode_batch([5] * b, caches)
    return cpu_ms(one, 1, tries=6)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args(argv)
    import mixqrt
    from mixqrt import ops
    lm = mixqrt.load(a.model, threads=2, progress=False)
    ops.local_threads(1)
    m = lm.model
    L = m.layers[0]
    tensors = {"q/k/v": L.qkv[0], "o_proj": L.o_proj, "gate/up": L.gate_up[0], "down_proj": L.down,
               "lm_head": m.lm_head}
    rng = np.random.default_rng(0)
    prod = {}
    steps = {}
    for _ in range(a.rounds):
        for on in (False, True):
            ops.set_gemm_cache(8 << 30 if on else 0)
            for name, w in tensors.items():
                for t in TS:
                    x = rng.standard_normal((t, w.shape[1])).astype(np.float32)
                    reps = 2 if name == "lm_head" else 20
                    v = cpu_ms(lambda: ops.matmul(w, x), reps)
                    k = (name, t, on)
                    prod[k] = min(prod.get(k, v), v)
            for b in BS:
                v = step_ms(m, b)
                steps[(b, on)] = min(steps.get((b, on), v), v)
            print(f"round done (cache {'on' if on else 'off'}): steps " +
                  " ".join(f"B={b} {steps[(b, on)]:.1f}" for b in BS), flush=True)
    same = {}
    ops.set_gemm_cache(8 << 30)
    from mixqrt._kernels import _ops
    for name, w in tensors.items():
        x = rng.standard_normal((8, w.shape[1])).astype(np.float32)
        with_tiles = ops.matmul(w, x)
        ops.set_gemm_cache(0)
        same[name] = bool(np.array_equal(with_tiles, ops.matmul(w, x)))
        ops.set_gemm_cache(8 << 30)
    tile_bytes = {name: _ops.gemm_tiles_bytes(*[ops._weight_args(w)[i] for i in (0, 2, 3)])
                  for name, w in tensors.items()}
    ops.set_gemm_cache(0)

    info = machine_info()
    cmd = "python benchmarks/gemm_tiles.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = [f"Run {info['date_utc']} (commit {info['git_commit']}): {info.get('cpu_model')}, ISA {info.get('isa')}, "
           f"load average at start {', '.join(f'{x:.1f}' for x in info['loadavg'])}; model "
           f"`{os.path.basename(a.model)}`; thread CPU ms, best of {a.rounds} alternated rounds.", "",
           f"Command: `{cmd}`", "",
           "| tensor (fmt, N x K) | packed MiB | tiles MiB | " + " | ".join(f"T={t} unpack / tiles" for t in TS)
           + " | T=8 identical |",
           "|---|---:|---:|" + "---:|" * len(TS) + "---|"]
    for name, w in tensors.items():
        cells = " | ".join(f"{prod[(name, t, False)]:.3f} / {prod[(name, t, True)]:.3f}" for t in TS)
        out.append(f"| {name} ({w.fmt}, {w.shape[0]} x {w.shape[1]}) | {w.nbytes / 2**20:.1f} | "
                   f"{tile_bytes[name] / 2**20:.1f} | {cells} | {'yes' if same[name] else 'NO'} |")
    out += ["", "| decode step | " + " | ".join(f"B={b}" for b in BS) + " | 8 x t(1) / t(8) |",
            "|---|" + "---:|" * (len(BS) + 1)]
    for on in (False, True):
        r = {b: steps[(b, on)] for b in BS}
        out.append(f"| {'tiles (cache on)' if on else 'unpack (cache off)'}, CPU ms | "
                   + " | ".join(f"{r[b]:.1f}" for b in BS) + f" | {8 * r[1] / r[8]:.2f}x |")
    text = "\n".join(out)
    print(text)
    if not a.no_doc:
        update_doc(ROOT / "docs" / "lab" / "kernels-gemm.md", {"gemm-tiles": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
