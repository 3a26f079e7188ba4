"""Decode at depth against decode at depth 0, measured in alternation in one process (issue 41's
"at 16,384 tokens, >= 0.6x mixqrt's own decode at depth 0").

Separate `mixqrt bench --depth 0` and `--depth 16384` runs minutes apart compare two states of a
shared machine: on the development VMs depth 0 runs at ~135-145 or ~180-195 tok/s for minutes at a
time (its step reads 300 MB of weights; the neighbours' memory traffic sets the speed), while depth
16k, more compute-bound, moves less. Here one loaded model holds two caches, one filled to the
depth, and the two decode in short alternating bursts (`--burst` steps each, after the same
128-token prompt as `mixqrt bench`'s TTFT prompt, as `mixqrt bench`'s tg does), so each pair of
bursts sees the same machine; the ratio is taken pair by pair and the median reported.

    flock LOCKFILE python benchmarks/depth_ratio.py MODEL.mxq --depth 16384 --rounds 30 --out FILE.json

Writes the per-round speeds and the medians as JSON (and prints a summary line).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info  # noqa: E402


def burst(model, cache, fill: np.ndarray, prompt: np.ndarray, n: int) -> float:
    """Back to the fill's tokens (mixqrt bench's rewind), the prompt after them, then n greedy decode
    steps -> tok/s of the steps."""
    from mixqrt.commands.bench import _rewind
    _rewind(model, cache, fill)
    logits = model(prompt, cache, fill.size, last_only=True)
    tok = int(np.argmax(logits))
    t = time.perf_counter()
    for _ in range(n):
        logits = model(np.array([tok]), cache, None, last_only=True)
        tok = int(np.argmax(logits))
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=".mxq file (or a name mixqrt.load understands)")
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--kv-type", default=None, help="default: the default KV type (q4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--burst", type=int, default=64, help="decode steps per burst")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args()

    from mixqrt import ops
    from mixqrt.commands.bench import _fill
    from mixqrt.pipeline import load
    ops.set_num_threads(a.threads)
    m = load(a.model, None, offline=True, progress=not a.quiet)
    model = m.model
    from mixqrt.models.kv_cache import check_kv_type
    kv = check_kv_type(a.kv_type, model.args.head_dim)
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    fill = rng.integers(100, min(vocab, 30000), size=a.depth)
    prompt = rng.integers(100, min(vocab, 30000), size=128)
    need = 128 + a.burst + 8
    c0 = model.make_cache(need + 64, kv)
    cd = model.make_cache(a.depth + need + 64, kv)
    _fill(model, cd, fill, not a.quiet)
    none = fill[:0]
    burst(model, c0, none, prompt, 8)                  # warm both paths
    burst(model, cd, fill, prompt, 8)
    rows = []
    for r in range(a.rounds):
        first_deep = bool(r % 2)                       # alternate which of the pair runs first
        order = [("deep", cd, fill), ("zero", c0, none)] if first_deep else [("zero", c0, none), ("deep", cd, fill)]
        res = {name: burst(model, c, s, prompt, a.burst) for name, c, s in order}
        rows.append({"zero_tok_s": res["zero"], "deep_tok_s": res["deep"], "ratio": res["deep"] / res["zero"]})
        if not a.quiet:
            print(f"round {r + 1}: depth 0 {res['zero']:.1f} tok/s, depth {a.depth} {res['deep']:.1f} tok/s, "
                  f"ratio {res['deep'] / res['zero']:.3f}", file=sys.stderr)
    ratios = [x["ratio"] for x in rows]
    out = {"model": str(a.model), "kv_type": kv, "depth": a.depth, "threads": a.threads, "burst": a.burst,
           "rounds": rows, "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
           "max_ratio": max(ratios),
           "median_zero_tok_s": statistics.median(x["zero_tok_s"] for x in rows),
           "median_deep_tok_s": statistics.median(x["deep_tok_s"] for x in rows),
           "loadavg": os.getloadavg(), "machine": machine_info()}
    print(f"depth {a.depth} / depth 0, {kv}, {a.threads} threads, {a.rounds} pairs of {a.burst} steps: median ratio "
          f"{out['median_ratio']:.3f} (min {out['min_ratio']:.3f}, max {out['max_ratio']:.3f}); depth 0 "
          f"{out['median_zero_tok_s']:.1f} tok/s, depth {a.depth} {out['median_deep_tok_s']:.1f} tok/s")
    if a.out:
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=str))
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
