"""Crash-proof harness for the long file-format fuzz runs (benchmarks/fuzz_gguf.py, fuzz_safetensors.py;
benchmarks/fuzz_mxq.py uses its per-case time limit). The mutators and the oracle of the GGUF and
safetensors runs are in mixqrt.testing.fuzz_files, shared with tests/test_model_fuzz.py.

Cases run in a forked worker so that a crash (segfault, SIGBUS, abort) kills only the worker: the
parent records the case it was on as a CRASH and starts a new worker at the next case. A per-case
SIGALRM turns a slow case into a HANG; a worker stuck where the alarm cannot reach (inside C) is
killed by the parent after 3x the limit and recorded as a HANG too. The worker's address space is
capped (--mem-gb) so a file that makes the reader allocate without bound shows up as a MemoryError
finding instead of taking the machine down. Case i's ops come from random.Random(f"{seed}:{i}"),
so every finding is reproducible alone.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import sys
import time
import traceback


class Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise Hang()


def rand_ops(r: random.Random, n_kinds: int):
    from mixqrt.testing.fuzz_files import INTERESTING
    def num():
        return r.choice([r.randrange(300), r.randrange(1 << 24), r.choice(INTERESTING)])
    return [(r.randrange(n_kinds), num(), num()) for _ in range(r.choice([1, 1, 2, 3, 4]))]


def case_ops(seed: int, i: int, n_seeds: int, n_kinds: int):
    """(seed file index, ops) of case i: what run_case draws from random.Random(f"{seed}:{i}")."""
    r = random.Random(f"{seed}:{i}")
    return r.randrange(n_seeds), rand_ops(r, n_kinds)


def _worker(conn, start, n, seed, timeout, mem_gb, make_runner):
    resource.setrlimit(resource.RLIMIT_AS, (int(mem_gb * (1 << 30)),) * 2)
    os.environ.setdefault("RUST_BACKTRACE", "0")
    signal.signal(signal.SIGALRM, _alarm)
    run_case = make_runner()
    for i in range(start, n):
        conn.send(("start", i))
        t = time.perf_counter()
        info = None
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            out = run_case(random.Random(f"{seed}:{i}"))
        except Hang:
            out = "HANG"
        except KeyboardInterrupt:
            raise
        except BaseException as e:                      # noqa: BLE001 - anything untyped is a finding
            out, info = "ERROR", "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        conn.send(("done", i, out, info, time.perf_counter() - t))
    conn.send(("end",))


def main(name: str, make_runner, describe, argv=None) -> int:
    """make_runner() -> run_case(rng) -> 'rejected' | 'loaded' (called in the worker);
    describe(seed, i) -> JSON-able description of case i for the failure report."""
    ap = argparse.ArgumentParser(description=f"mutation fuzz of the {name} reader")
    ap.add_argument("-n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=5.0, help="seconds per case before it is a hang")
    ap.add_argument("--mem-gb", type=float, default=3.0, help="address-space cap of the worker")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import shutil
    import tempfile
    # workers make their case files under one scratch folder, removed at the end even after crashes
    scratch = tempfile.mkdtemp(prefix=f"fuzz-{name}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ["TMPDIR"] = scratch
    tempfile.tempdir = None
    ctx = mp.get_context("fork")
    outcomes: collections.Counter = collections.Counter()
    failures, slowest, t0 = [], (0.0, None), time.perf_counter()
    nxt = 0
    while nxt < args.n:
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(child, nxt, args.n, args.seed, args.timeout, args.mem_gb, make_runner))
        p.start()
        child.close()
        current = nxt
        while True:
            if not parent.poll(args.timeout * 3 + 5):
                p.kill()
                p.join()
                outcomes["HANG"] += 1
                failures.append({"case": current, "error": "hang (worker unresponsive)", **describe(args.seed, current)})
                nxt = current + 1
                break
            try:
                msg = parent.recv()
            except EOFError:                             # the worker died mid-case
                p.join()
                outcomes["CRASH"] += 1
                failures.append({"case": current, "error": f"crash (exit {p.exitcode})", **describe(args.seed, current)})
                nxt = current + 1
                break
            if msg[0] == "start":
                current = msg[1]
            elif msg[0] == "done":
                _, i, out, info, dt = msg
                outcomes[out] += 1
                if out in ("ERROR", "HANG"):
                    failures.append({"case": i, "error": info or "hang", **describe(args.seed, i)})
                if dt > slowest[0]:
                    slowest = (dt, i)
                if (i + 1) % 10000 == 0:
                    print(f"{i + 1:>7} cases  {time.perf_counter() - t0:7.1f} s  {dict(outcomes)}", flush=True)
                nxt = i + 1
            else:
                p.join()
                nxt = args.n
                break
        parent.close()
    shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - t0
    summary = {"fuzzer": name, "cases": args.n, "seed": args.seed, "timeout_s": args.timeout,
               "wall_s": round(wall, 1), "cases_per_s": round(args.n / wall, 1),
               "outcomes": dict(outcomes), "crashes": outcomes["CRASH"], "hangs": outcomes["HANG"],
               "non_typed_errors": outcomes["ERROR"], "slowest_case_ms": round(slowest[0] * 1e3, 2),
               "slowest_case": slowest[1], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
               "failures": failures[:30]}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    for f in failures[:10]:
        print(json.dumps(f)[:4000])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 1 if failures else 0
