"""Prompt-cache isolation, measured: what user B learns about user A's prompt from
`cached_tokens` and from the response time, with the shared cache, another `cache_salt`, and
another API key.

    python benchmarks/cache_isolation.py                 # tiny model, 30 probes per case
    python benchmarks/cache_isolation.py --quick         # 6 probes, no docs written

Each rep, user A sends a new secret as a chat's system prompt: a PIN, then --prefix-chars of random
text that B is assumed to know (a published system prompt with a secret in it). User B then sends
one probe: the whole prompt with the PIN guessed right (even reps) or with its first digit wrong
(odd reps), and "?" at the end. Where the cache is shared, a right guess reuses A's whole prefix
and a wrong one recomputes everything after the PIN: the time to the first token tells them apart.
Secrets differ after the PIN, so B's earlier probes help B only up to it. Reported per case: the
median cached_tokens and request time (one new token, non-streaming: the time to the first token
plus one token) of right and wrong guesses.
Cases: `shared` (no salt, no keys: the default), `same_salt` (both send one salt: sharing on
purpose, the cache must still hit), `salt` (A and B send different cache_salt values),
`key` (a server with two API keys, A and B each with its own). Nothing is asserted on time; the
table goes between the `mixqrt:server-cache-isolation` markers of docs/server.md.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import machine_info, update_doc, write_json  # noqa: E402
from cache_flood import start_server, stop_server, tiny_mxq  # noqa: E402


class Server:
    def __init__(self, model: Path, tmp: Path, threads: int, keys=()):
        args = [str(model), "-t", str(threads)]
        if keys:
            (tmp / "keys").write_text("\n".join(keys) + "\n")
            args += ["--api-key-file", str(tmp / "keys")]
        self.proc, self.port = start_server(args, str(ROOT), tmp)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

    def ask(self, system: str, key=None, salt=None) -> tuple[int, float]:
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
                "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        t = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        r = self.conn.getresponse()
        data = json.loads(r.read())
        dt = time.perf_counter() - t
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {data}")
        return data["usage"]["prompt_tokens_details"]["cached_tokens"], dt

    def close(self):
        self.conn.close()
        stop_server(self.proc)


def probe_case(srv: Server, reps: int, chars: int, a: dict, b: dict, rng: random.Random) -> dict:
    out = {"right": [], "wrong": []}
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    for rep in range(reps):
        text = "".join(rng.choice(alphabet) for _ in range(chars))
        pin = f"{rng.randrange(10000):04d}"
        srv.ask(f"The code is {pin}. {text}", **a)
        right = rep % 2 == 0
        guess = pin if right else str((int(pin[0]) + 1 + rng.randrange(9)) % 10) + pin[1:]
        cached, dt = srv.ask(f"The code is {guess}. {text}?", **b)
        out["right" if right else "wrong"].append((cached, dt))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .mxq (default: the tests' tiny model, made here)")
    ap.add_argument("--reps", type=int, default=60, help="probes per case (half right, half wrong)")
    ap.add_argument("--prefix-chars", type=int, default=180, help="secret text length (the tiny context is 256)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--block", default="server-cache-isolation",
                    help="the docs/server.md block (and docs/data/BLOCK.json) the table goes to")
    a = ap.parse_args()
    if a.quick:
        a.reps = 6
    tmp = Path(tempfile.mkdtemp(prefix="cache-iso-"))
    model = Path(a.model) if a.model else tiny_mxq(tmp)
    rng = random.Random(0)
    cases = {}
    srv = Server(model, tmp, a.threads)
    try:
        srv.ask("warm up " * 20)
        cases["shared"] = probe_case(srv, a.reps, a.prefix_chars, {}, {}, rng)
        cases["same_salt"] = probe_case(srv, a.reps, a.prefix_chars, {"salt": "team"}, {"salt": "team"}, rng)
        cases["salt"] = probe_case(srv, a.reps, a.prefix_chars, {"salt": "alice"}, {"salt": "bob"}, rng)
    finally:
        srv.close()
    srv = Server(model, tmp, a.threads, keys=("key-alice", "key-bob"))
    try:
        srv.ask("warm up " * 20, key="key-alice")
        cases["key"] = probe_case(srv, a.reps, a.prefix_chars, {"key": "key-alice"}, {"key": "key-bob"}, rng)
    finally:
        srv.close()
    med = statistics.median
    summary = {}
    for name, c in cases.items():
        summary[name] = {g: {"cached": med(x[0] for x in c[g]), "ms": 1000 * med(x[1] for x in c[g]),
                             "ms_p10": 1000 * sorted(x[1] for x in c[g])[len(c[g]) // 10],
                             "ms_p90": 1000 * sorted(x[1] for x in c[g])[(9 * len(c[g])) // 10]}
                         for g in ("right", "wrong")}
        print(name, json.dumps(summary[name]))
    res = {"machine": machine_info(), "command": " ".join(["python"] + sys.argv), "model": model.name,
           "reps": a.reps, "prefix_chars": a.prefix_chars, "threads": a.threads, "cases": cases, "summary": summary}
    if not a.quick:
        write_json(ROOT / "docs" / "data" / f"{a.block}.json", res)
        write_doc(res, a.block)


def write_doc(r: dict, block: str) -> None:
    m = r["machine"]
    names = {"shared": "shared cache (no salt, no keys: the default)",
             "same_salt": "A and B send the same cache_salt (sharing on purpose)",
             "salt": "A and B send different cache_salt",
             "key": "A and B use different API keys"}
    lines = [f"{m.get('cpu_model')}, {r['threads']} kernel threads, {m['date_utc']}, commit {m['git_commit']}, "
             f"load average {m['loadavg'][0]:.1f} at the end. Model `{r['model']}`. Command: `{r['command']}`. "
             f"{r['reps'] // 2} right and {r['reps'] // 2} wrong guesses of a PIN per case, each against a new "
             f"secret (the PIN, then {r['prefix_chars']} known characters); times are whole requests for one "
             "new token "
             "(median, [p10, p90]).", "",
             "| case | right guess: cached tokens | wrong guess: cached tokens | right guess ms | wrong guess ms |",
             "|---|---:|---:|---:|---:|"]
    for k, s in r["summary"].items():
        rt, wr = s["right"], s["wrong"]
        lines.append(f"| {names[k]} | {rt['cached']:.0f} | {wr['cached']:.0f} | {rt['ms']:.1f} "
                     f"[{rt['ms_p10']:.1f}, {rt['ms_p90']:.1f}] | {wr['ms']:.1f} "
                     f"[{wr['ms_p10']:.1f}, {wr['ms_p90']:.1f}] |")
    update_doc(ROOT / "docs" / "server.md", {block: "\n".join(lines)})


if __name__ == "__main__":
    main()
