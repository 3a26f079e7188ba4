"""Decode speed of one model file with a tuning switch at two or more values, alternated in fresh processes.

    flock /work/bench.lock python benchmarks/switch_ab.py MODEL.mxq --switch MIXQRT_MV_XPF [--values 0,1]
        [--rounds 3] [--threads 2] [--n-gen 64] [--n-prompt 64]
    python benchmarks/switch_ab.py MODEL.mxq --switch MIXQRT_Q2C_MV --switch MIXQRT_MV_XPF --values 0,1

Each round runs `mixqrt bench MODEL -t THREADS -p N_PROMPT -n N_GEN -r 3 --json` once per value, the
value set in the environment of a fresh process (a switch of mixqrt.platform.tuning is read at
import), values alternated so that machine noise hits them alike. Several --switch flags move
together (every named switch takes the value). Reported: tg tok/s per round, the median per value and
its ratio to the first value's. Tests never assert on these numbers; the kernel docs quote them with
the machine and load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
from _common import last_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--switch", action="append", required=True, help="environment switch (repeatable)")
    ap.add_argument("--values", default="0,1", help="comma list of values (default 0,1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--n-prompt", type=int, default=64)
    a = ap.parse_args(argv)
    from mixqrt.platform import tuning
    for name in a.switch:
        if name not in {s.name for s in tuning.SWITCHES}:
            raise SystemExit(f"unknown switch {name!r} (mixqrt.platform.tuning.SWITCHES)")
    values = [v for v in a.values.split(",") if v]
    got: dict[str, list[float]] = {v: [] for v in values}
    for r in range(a.rounds):
        for v in values:
            env = dict(os.environ, **{name: v for name in a.switch})
            cmd = [sys.executable, "-m", "mixqrt", "bench", a.model, "-t", str(a.threads), "-p", str(a.n_prompt),
                   "-n", str(a.n_gen), "-r", "3", "--json", "-q"]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            row = last_json(p.stdout)
            if p.returncode or not isinstance(row, dict):
                raise SystemExit(f"mixqrt bench failed ({'='.join((a.switch[0], v))}): {p.stderr.strip()[-500:]}")
            got[v].append(row["tg_tok_s"])
            print(f"round {r + 1} {','.join(a.switch)}={v}: tg {row['tg_tok_s']:.1f} tok/s", flush=True)
    base = statistics.median(got[values[0]])
    out = {v: {"rounds": got[v], "median": statistics.median(got[v]), "ratio": statistics.median(got[v]) / base}
           for v in values}
    for v in values:
        print(f"{','.join(a.switch)}={v}: median {out[v]['median']:.1f} tok/s, {out[v]['ratio']:.2f}x {values[0]}")
    print(json.dumps({"switches": a.switch, "threads": a.threads, "n_gen": a.n_gen, "results": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
