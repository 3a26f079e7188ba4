"""Single-line fill-in-the-middle exact match: mixqrt's default file against llama.cpp types through
llama-server's /infill, on the same weights, greedy, side by side in one run.

The set (``cases``): Python standard-library source of the running interpreter. Files: every ``*.py``
under the stdlib folder outside test / tests / idle_test / site-packages folders, sorted; one random.Random(SEED) picks, per file, one simple statement
inside a function body that sits on one line (not a docstring, not a def / class / decorator line,
8-80 characters once stripped). That statement's text is the middle; the prefix is the 30 lines before
it plus the line's indentation, the suffix the rest of its line (a newline) and the 10 lines after it.
Files are taken in a shuffled order until N cases (default 200) are found. A completion counts when its
first line, stripped, equals the statement stripped. Every system gets the same texts and stops at a
newline (``stop: ["\\n"]``), 48 tokens at most.

    MIXQRT_LLAMA_CPP_BIN=/work/llama/build/bin flock /work/bench.lock python benchmarks/fim_exact.py \\
        --mxq ~/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4a-*.mxq \\
        --gguf Q3_K_M=/tmp/fim-gguf/qwen-q3_k_m.gguf --gguf Q8_0=/tmp/fim-gguf/qwen-q8_0.gguf \\
        --json docs/data/fim-exact.json

The GGUFs: llama-quantize --allow-requantize qwen2.5-coder-0.5b-instruct-q4_k_m.gguf qwen-f32.gguf F32,
then llama-quantize qwen-f32.gguf qwen-q3_k_m.gguf Q3_K_M (and Q8_0): the same weights mixqrt's default
file was quantized from.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SEED = 40
BEFORE, AFTER = 30, 10
N_PREDICT = 48


def _candidates(src: str) -> list[int]:
    """0-based line numbers of one-line simple statements inside function bodies."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]                                      # the docstring
        for node in ast.walk(ast.Module(body=body, type_ignores=[])):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Expr, ast.Raise,
                                 ast.Assert, ast.Delete)) and node.lineno == node.end_lineno:
                out.append(node.lineno - 1)
    return sorted(set(out))


def cases(n: int = 200, seed: int = SEED) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if p.is_file() and not skip & set(p.relative_to(root).parts))
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines = src.split("\n")
        cand = [i for i in _candidates(src) if 8 <= len(lines[i].strip()) <= 80 and not lines[i].strip().startswith("#")]
        if not cand:
            continue
        i = rng.choice(cand)
        line = lines[i]
        indent = line[:len(line) - len(line.lstrip())]
        target = line.strip()
        prefix = "\n".join(lines[max(0, i - BEFORE):i]) + "\n" + indent
        suffix = "\n" + "\n".join(lines[i + 1:i + 1 + AFTER])
        out.append({"file": str(f.relative_to(root)), "line": i + 1, "target": target, "prefix": prefix, "suffix": suffix})
        if len(out) == n:
            break
    return out


def first_line(s: str) -> str:
    return s.split("\n", 1)[0].strip()


def run_mixqrt(mxq: str, cs: list[dict]) -> list[str]:
    import mixqrt
    pipe = mixqrt.Pipeline(mxq, progress=False)
    outs = []
    for c in cs:
        outs.append(pipe.infill(c["prefix"], c["suffix"], max_new_tokens=N_PREDICT, temperature=0, stop=["\n"]))
    pipe.close()
    return outs


def run_llama(name: str, gguf: str, cs: list[dict], threads: int, log_dir: Path, partial=None) -> list[str]:
    from _llama_server import start_llama_server
    srv = start_llama_server(f"fim-{name}", gguf, threads, 4096, log_dir).wait_ready()
    outs = []
    try:
        for c in cs:
            body = {"input_prefix": c["prefix"], "input_suffix": c["suffix"], "n_predict": N_PREDICT,
                    "temperature": 0.0, "top_k": 1, "stop": ["\n"], "cache_prompt": False, "stream": False}
            req = urllib.request.Request(srv.url + "/infill", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                outs.append(json.loads(r.read())["content"])
            if partial is not None:              # one line per case: a cut-short run still counts its cases
                with open(partial, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"system": name, "i": len(outs) - 1, "output": outs[-1]}) + "\n")
    finally:
        srv.stop()
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mxq", default=None, help="mixqrt's file (the default q4a of the test GGUF); none: llama.cpp only")
    ap.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH", help="llama.cpp files (repeatable)")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default="/tmp/fim-exact-logs")
    ap.add_argument("--partial", default=None, help="append each llama.cpp output to this JSONL file as it comes")
    a = ap.parse_args(argv)
    cs = cases(a.n)
    key = hashlib.sha256(json.dumps([(c["file"], c["line"], c["target"]) for c in cs]).encode()).hexdigest()[:16]
    print(f"{len(cs)} cases from {sysconfig.get_paths()['stdlib']} (Python {sys.version.split()[0]}), set {key}",
          flush=True)
    load0 = os.getloadavg()
    results = {}
    systems = [("mixqrt:" + Path(a.mxq).name, lambda: run_mixqrt(a.mxq, cs))] if a.mxq else []
    for spec in a.gguf:
        name, _, path = spec.partition("=")
        systems.append((f"llama.cpp:{name}", lambda n=name, p=path: run_llama(n, p, cs, a.threads, Path(a.log_dir),
                                                                                a.partial)))
    for name, fn in systems:
        t = time.perf_counter()
        outs = fn()
        hits = [first_line(o) == c["target"] for o, c in zip(outs, cs)]
        results[name] = {"exact": sum(hits), "cases": len(cs), "rate": sum(hits) / len(cs),
                         "seconds": time.perf_counter() - t, "outputs": [first_line(o) for o in outs]}
        print(f"{name:48s} exact match {sum(hits):3d}/{len(cs)} = {100 * sum(hits) / len(cs):5.1f} %  "
              f"({results[name]['seconds']:.0f} s)", flush=True)
    doc = {"set": {"n": len(cs), "sha": key, "seed": SEED, "before": BEFORE, "after": AFTER,
                   "python": sys.version.split()[0], "cases": [[c["file"], c["line"], c["target"]] for c in cs]},
           "n_predict": N_PREDICT, "threads": a.threads, "load_before": load0, "load_after": os.getloadavg(),
           "results": results, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if a.json:
        from mixqrt.io.atomic import atomic_write
        with atomic_write(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
