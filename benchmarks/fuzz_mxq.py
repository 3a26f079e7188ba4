"""Long fuzz of the .mxq reader (outside CI): N mutated files, each must end in FormatError or a load
that the oracle in tests/test_mxq_fuzz.py accepts. Prints and optionally saves the outcome table.

    python benchmarks/fuzz_mxq.py -n 100000 [--seed 0] [--json out.json] [--timeout 5]

A case that raises anything else, or runs past --timeout seconds, is a failure: its seed file index and
ops are printed so `mutate(seed_files()[i], ops)` reproduces it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]
from test_mxq_fuzz import INTERESTING, N_OPS, check, mutate, seed_files  # noqa: E402

from mixqrt.testing.fuzz import Hang, _alarm  # noqa: E402  (the GGUF/safetensors fuzzers' per-case time limit)

from mixqrt.errors import FormatError  # noqa: E402
from mixqrt.io.mxq import MxqFile  # noqa: E402


def _category(msg: str) -> str:
    msg = msg.split(": ", 1)[1] if msg.startswith("/") else msg
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"-?\d+", "N", msg)
    return msg[:60]


def _rand_int(r: random.Random) -> int:
    return r.choice([r.randrange(300), r.randrange(1 << 24), r.choice(INTERESTING) % (1 << 24)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    seeds = seed_files()
    r = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="mxqfuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(tmp, "case.mxq")
    outcomes: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    op_kinds: collections.Counter = collections.Counter()
    failures = []
    slowest = (0.0, None)
    signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    try:
        for case in range(args.n):
            si = r.randrange(len(seeds))
            ops = [(r.randrange(N_OPS), _rand_int(r), _rand_int(r)) for _ in range(r.choice([1, 1, 2, 3, 4]))]
            for k, _, _ in ops:
                op_kinds[k] += 1
            data = mutate(seeds[si], ops)
            with open(path, "wb") as fh:
                fh.write(data)
            t = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, args.timeout)
            try:
                out = check(path)
                if out == "rejected":
                    try:
                        MxqFile(path).close()
                    except FormatError as e:
                        reasons[_category(str(e))] += 1
            except Hang:
                out = "HANG"
                failures.append({"seed": si, "ops": ops, "error": "hang"})
            except Exception as e:                                 # noqa: BLE001 - that is the point
                out = "CRASH"
                failures.append({"seed": si, "ops": ops, "error": repr(e), "tb": traceback.format_exc()})
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            dt = time.perf_counter() - t
            if dt > slowest[0]:
                slowest = (dt, {"seed": si, "ops": ops})
            outcomes[out] += 1
            if (case + 1) % 10000 == 0:
                print(f"{case + 1:>7} cases  {time.perf_counter() - t0:7.1f} s  {dict(outcomes)}", flush=True)
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    summary = {"cases": args.n, "seed": args.seed, "wall_s": round(wall, 1), "cases_per_s": round(args.n / wall),
               "outcomes": dict(outcomes), "slowest_case_ms": round(slowest[0] * 1e3, 2),
               "op_kinds": {k: op_kinds[k] for k in sorted(op_kinds)},
               "top_reasons": reasons.most_common(40), "failures": failures[:20]}
    print(json.dumps({k: v for k, v in summary.items() if k != "top_reasons"}, indent=1))
    print(f"distinct rejection reasons: {len(reasons)}")
    for msg, n in reasons.most_common(40):
        print(f"{n:>7}  {msg}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
