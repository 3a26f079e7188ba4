"""Projection: speculative decoding of Qwen2-7B with a Qwen2.5-0.5B draft, from measured step times.

    python benchmarks/synthetic_mxq.py --recipe 2356t --config 7b --out /tmp/mixqrt-7b-2356t.mxq
    python benchmarks/speculative_7b.py --target /tmp/mixqrt-7b-2356t.mxq --draft DRAFT.mxq -t 2

No Qwen2-7B weights exist here, so the speed-up is projected, not measured:
  * measured, in one process, rounds alternated: the target's plain step (1 row), its verify step
    (k + 1 rows, k = 1..8) on the synthetic Qwen2-7B-shaped file (seeded random packed weights in the
    recipe's formats: the same bytes and kernels as a real one), and the draft's step (1 row) on a real
    0.5B file, each after a --ctx-token prompt;
  * measured elsewhere: the acceptance rate a (accepted / drafted tokens) of each prompt set from the
    real 0.5B pair, read from docs/data/speculative*.json (benchmarks/speculative.py);
  * the formula, with draft tokens accepted independently with probability a: a verify of k drafts
    yields E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs k * t_draft + t_verify(k + 1), so
        speed-up(k) = E(k) * t_plain / (k * t_draft + t_verify(k + 1)),
    reported at the best k (prompt lookup: t_draft = 0).
Writes the table between the speculative-7b markers of docs/speculative.md and docs/data/speculative-7b.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from _common import provenance, update_doc, write_json  # noqa: E402

from mixqrt.generation.speculative import expected_tokens  # noqa: E402

KS = range(1, 9)


def step_times(lm, ctx: int, rows: list[int], rounds: int, seed: int) -> dict[int, list[float]]:
    """Seconds of one forward of T rows after a ctx-token prompt, per T, rounds alternated."""
    import numpy as np
    rng = np.random.default_rng(seed)
    model = lm.model
    vocab = model.vocab_size
    kv = model.make_cache(ctx + max(rows) + 1)
    model(rng.integers(0, vocab, ctx), kv, last_only=True)
    out = {t: [] for t in rows}
    for r in range(rounds + 1):
        order = rows if r % 2 == 0 else rows[::-1]
        for t in order:
            ids = rng.integers(0, vocab, t)
            t0 = time.perf_counter()
            model(ids, kv)
            dt = time.perf_counter() - t0
            kv.trim(t)
            if r:                          # round 0 warms every shape up
                out[t].append(dt)
    return out


def acceptance(path: Path) -> dict[str, dict[str, float]]:
    """setting -> set -> accepted / drafted, from benchmarks/speculative.py's results."""
    if not path.exists():
        return {}
    res = json.loads(path.read_text())
    acc: dict = {}
    for r in res.get("results", []):
        if r["setting"] == "plain" or not r.get("drafted"):
            continue
        d = acc.setdefault(r["setting"], {}).setdefault(r["set"], [0, 0])
        d[0] += r["accepted"]
        d[1] += r["drafted"]
    return {s: {k: v[0] / v[1] for k, v in by.items() if v[1]} for s, by in acc.items()}


def project(t_plain: float, t_verify: dict[int, float], t_draft: float, a: float) -> tuple[int, float]:
    best = (0, 1.0)
    for k in KS:
        x = expected_tokens(a, k) * t_plain / (k * t_draft + t_verify[k + 1])
        if x > best[1]:
            best = (k, x)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="the Qwen2-7B-shaped .mxq (benchmarks/synthetic_mxq.py --config 7b)")
    ap.add_argument("--draft", required=True, help="the draft .mxq (the real 0.5B default file)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256, help="prompt tokens before the timed steps")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--acceptance", action="append", default=None,
                    help="benchmarks/speculative.py results to take acceptance rates from (repeatable; default "
                    "every docs/data/speculative*.json but this script's own)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "data" / "speculative-7b.json"))
    a = ap.parse_args(argv)
    from mixqrt.pipeline import LoadedModel
    target = LoadedModel(a.target, threads=a.threads)
    draft = LoadedModel(a.draft, threads=a.threads)
    rows = [1] + [k + 1 for k in KS]
    med = statistics.median
    tt = {t: med(v) for t, v in step_times(target, a.ctx, rows, a.rounds, 0).items()}
    td = med(step_times(draft, a.ctx, [1], a.rounds, 1)[1])
    files = a.acceptance or sorted(str(f) for f in (ROOT / "docs" / "data").glob("speculative*.json")
                                   if f.name != Path(a.out).name)
    acc = {}
    for f in files:
        for setting, by in acceptance(Path(f)).items():
            acc[f"{setting} ({Path(f).stem})"] = by
    proj = {s: {name: dict(zip(("k", "speedup"), project(tt[1], tt, 0.0 if s.startswith("lookup") else td, al)),
                             acceptance=al) for name, al in by.items()} for s, by in acc.items()}
    cmd = "python benchmarks/speculative_7b.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = {"target": a.target, "draft": a.draft, "threads": a.threads, "ctx": a.ctx, "rounds": a.rounds,
           "t_plain_s": tt[1], "t_verify_s": {str(t): v for t, v in tt.items()}, "t_draft_s": td,
           "acceptance": acc, "projection": proj, "command": cmd}
    write_json(a.out, res)
    L = [provenance(cmd), "**A projection, not a measurement of Qwen2-7B.** Measured: the step times below "
         f"(median of {a.rounds} alternated rounds after a {a.ctx}-token prompt, {a.threads} threads); the "
         "acceptance rates of the real 0.5B pair (docs/data/speculative.json). Formula: speed-up(k) = "
         "E(k) x t_plain / (k x t_draft + t_verify(k+1)), E(k) = (1 - a^(k+1)) / (1 - a); best k shown.", "",
         f"| rows per step | 1 (plain) | " + " | ".join(str(k + 1) for k in KS) + " |",
         "|---|---:|" + "---:|" * len(KS),
         f"| `{Path(a.target).name}` ms | {1e3 * tt[1]:.1f} | " + " | ".join(f"{1e3 * tt[k + 1]:.1f}" for k in KS) + " |",
         "| cost vs 1 row | 1.00x | " + " | ".join(f"{tt[k + 1] / tt[1]:.2f}x" for k in KS) + " |", "",
         f"Draft step (`{Path(a.draft).name}`, 1 row): {1e3 * td:.1f} ms = {td / tt[1]:.3f} of the target's step.", "",
         "| drafting (real 0.5B pair) | prompt set | acceptance a | best k | projected speed-up |",
         "|---|---|---:|---:|---:|"]
    for s, by in proj.items():
        for name, p in by.items():
            L.append(f"| {s} | {name} | {p['acceptance']:.2f} | {p['k']} | {p['speedup']:.2f}x |")
    update_doc(ROOT / "docs" / "speculative.md", {"speculative-7b": "\n".join(L)})
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
