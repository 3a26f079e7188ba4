"""Fast apply: editing prompts over standard-library functions, plain decode against copy drafting.

    python benchmarks/apply_edits.py --target T.mxq [--kinds rename,fix,check,diff] [--per-kind 8]
        [--lookup 8] [--threads 2] [--part 1/2] [--llama-server-gguf T.gguf] [--llama-spec ngram-simple-n3m8]
    python benchmarks/apply_edits.py --list            # print the prompt set and exit

The prompt set (built here, deterministically, from the running interpreter's standard library:
`sysconfig.get_paths()["stdlib"]`): functions of 20-200 lines from the modules of MODULES, each
asked through the chat template, greedy, for one edit and "the whole function" back:
  rename  rename a parameter used at least three times;
  fix     a one-line fix: one comparison operator on a named line flipped (< to <=, == to !=, ...);
  check   add a check at the start of the body that raises TypeError for a parameter that is None;
  diff    apply a unified diff (two hunks: a comment added after the signature, one line changed).
Per prompt, in one process and in alternation: plain decoding, the copy drafter (--lookup K), and
the copy drafter with the request's `prediction` set to the original function; each output is
compared token for token with the plain one. With --llama-server-gguf, llama.cpp's llama-server
runs the same token-id prompts plain and with its n-gram speculation (--llama-spec). Raw results
to docs/data/apply-edits[-PART].json; --doc writes the table between the apply-edits markers of
docs/speculative.md from every part's json.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import inspect
import json
import os
import re
import statistics
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine_info, provenance, update_doc, write_json  # noqa: E402
from _llama_server import complete_ids  # noqa: E402

KINDS = ("rename", "fix", "check", "diff")
MODULES = ("textwrap", "shlex", "difflib", "heapq", "fnmatch", "tempfile", "shutil", "csv", "string",
           "statistics", "calendar", "argparse", "glob", "posixpath", "ipaddress", "fractions",
           "dataclasses", "functools", "configparser", "json.decoder", "json.encoder", "tokenize",
           "pprint", "base64", "quopri", "gettext", "locale", "mimetypes", "netrc", "plistlib")
TAIL = "\n\nReturn only the whole updated function in one ```python code block, without explanations."
FLIPS = (("<=", "<"), (">=", ">"), ("==", "!="), ("!=", "=="), (" < ", " <= "), (" > ", " >= "))


def _functions(min_lines: int, max_lines: int):
    """(qualified name, source) of the functions and methods of MODULES with min..max lines, in a
    fixed order (module, then position in the file)."""
    out = []
    for mod in MODULES:
        try:
            m = importlib.import_module(mod)
            src = inspect.getsource(m)
        except (ImportError, OSError, TypeError):
            continue
        lines = src.splitlines()
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef):
                        f._qual = f"{mod}.{node.name}.{f.name}"
        for node in tree.body + [f for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body]:
            if not isinstance(node, ast.FunctionDef) or node.decorator_list:
                continue
            n = node.end_lineno - node.lineno + 1
            if min_lines <= n <= max_lines:
                text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                out.append((getattr(node, "_qual", f"{mod}.{node.name}"), text, node))
    return out


def _params(node) -> list[str]:
    a = node.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]


def _uses(text: str, name: str) -> int:
    return len(re.findall(rf"\b{re.escape(name)}\b", text))


def _rename(name: str) -> str:
    return {"s": "text", "x": "value", "n": "count", "a": "first", "b": "second", "i": "index",
            "f": "func", "fp": "stream", "obj": "target", "path": "file_path"}.get(name, f"{name}_arg")


def make_prompt(kind: str, qual: str, text: str, node):
    """-> (instruction, source) or None when the function does not suit the kind."""
    body = text.splitlines()
    if kind == "rename":
        ps = [p for p in _params(node) if _uses(text, p) >= 4 and len(p) > 0]
        if not ps:
            return None
        p = max(ps, key=lambda p: _uses(text, p))
        return (f"Rename the parameter `{p}` of this function to `{_rename(p)}` everywhere in the function.", text)
    if kind == "fix":
        doc = isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant)
        start = (node.body[0].end_lineno if doc else node.lineno) - node.lineno + 1
        for i, line in enumerate(body[start:], start):
            if line.strip().startswith(("#", '"', "'")):
                continue
            for a, b in FLIPS:
                if a in line and line.count(a) == 1:
                    fixed = line.replace(a, b)
                    return (f"Fix this function: the line `{line.strip()}` must be `{fixed.strip()}`.", text)
        return None
    if kind == "check":
        ps = _params(node)
        if not ps or node.args.vararg is not None and ps[0] == node.args.vararg.arg:
            return None
        return (f"Add a check at the start of the function body that raises TypeError if `{ps[0]}` is None.",
                text)
    if kind == "diff":
        mid = len(body) // 2
        j = next((i for i in range(mid, len(body)) if body[i].strip() and not body[i].strip().startswith("#")
                  and "=" in body[i] and '"""' not in body[i]), None)
        if j is None:
            return None
        new = list(body)
        indent = re.match(r"\s*", body[j]).group(0)
        new[j] = body[j].rstrip() + "  # updated"
        first = next(i for i, ln in enumerate(body) if ln.rstrip().endswith(":"))
        ind1 = re.match(r"\s*", body[first + 1]).group(0) if first + 1 < len(body) else indent
        new.insert(first + 1, f"{ind1}# edited: see the change below")
        diff = "\n".join(difflib.unified_diff(body, new, "a.py", "b.py", lineterm="", n=2))
        return (f"Apply this diff to the function.\n\n```diff\n{diff}\n```", text)
    raise ValueError(kind)


def prompt_set(per_kind: int, kinds=KINDS, min_lines: int = 20, max_lines: int = 200, max_chars: int = 3000):
    """[{kind, name, lines, messages, source}]: per kind, the first `per_kind` suitable functions of
    at most max_chars characters, each function used once across the set."""
    funcs = [f for f in _functions(min_lines, max_lines) if len(f[1]) <= max_chars]
    used, out = set(), []
    for kind in kinds:
        got = 0
        for i, (qual, text, node) in enumerate(funcs):
            if got >= per_kind:
                break
            # spread the kinds over the modules: each kind starts at another offset
            qual, text, node = funcs[(i * 7 + KINDS.index(kind) * 3) % len(funcs)]
            if qual in used:
                continue
            p = make_prompt(kind, qual, text, node)
            if p is None:
                continue
            used.add(qual)
            got += 1
            msg = f"{p[0]}\n\n```python\n{p[1]}\n```{TAIL}"
            out.append({"kind": kind, "name": qual, "lines": len(text.splitlines()),
                        "messages": [{"role": "user", "content": msg}], "source": p[1]})
    return out


def run(pipe, item, max_tokens, prediction=False):
    kw = {"prediction": item["source"]} if prediction else {}
    steps0 = pipe.engine.stats()["verify_steps"]
    t0 = time.perf_counter()
    pieces = list(pipe.stream(item["messages"], max_new_tokens=max_tokens, temperature=0, **kw))
    dt = time.perf_counter() - t0
    steps = pipe.engine.stats()["verify_steps"] - steps0
    last = pieces[-1]
    toks = [p.token for p in pieces if p.token is not None]
    decode_s = max(1e-9, dt - last.ttft_s)
    return {"tokens": toks, "n": len(toks), "wall_s": dt, "ttft_s": last.ttft_s,
            "decode_tps": (len(toks) - 1) / decode_s if len(toks) > 1 else 0.0,
            "drafted": last.draft_tokens, "accepted": last.accepted_draft_tokens, "verify_steps": steps,
            "finish": last.finish_reason}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="the model (.mxq or anything Pipeline takes)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--per-kind", type=int, default=8)
    ap.add_argument("--part", default="1/1", help="I/N: run the I-th of N slices of the prompt set")
    ap.add_argument("--lookup", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=0, help="cap the new tokens of every run (0: 1.5x the "
                    "function's tokens + 64, the whole function back); the speed-up then covers the reply's start")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-lines", type=int, default=200)
    ap.add_argument("--max-chars", type=int, default=3000, help="longest function source in the set")
    ap.add_argument("--free", action="store_true", help="also free generation (benchmarks/speculative.py's "
                    "free set), plain against the copy drafter")
    ap.add_argument("--no-prediction", action="store_true")
    ap.add_argument("--llama-server-gguf", default=None)
    ap.add_argument("--llama-spec", default="ngram-simple-n3m8")
    ap.add_argument("--llama-plain", action="store_true", help="llama-server's plain decoding too")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--doc", action="store_true", help="write docs/speculative.md's table from the saved parts")
    ap.add_argument("--tag", default="apply-edits")
    a = ap.parse_args()
    if a.doc:
        write_doc(a.tag)
        return
    kinds = a.kinds.split(",")
    items = prompt_set(a.per_kind, kinds, max_lines=a.max_lines, max_chars=a.max_chars)
    i, n = (int(v) for v in a.part.split("/"))
    items = items[i - 1::n]
    if a.list:
        for it in items:
            print(it["kind"], it["name"], it["lines"], it["messages"][0]["content"].split("\n")[0][:110])
        print(len(items), "prompts")
        return
    import mixqrt
    plain = mixqrt.Pipeline(a.target, threads=a.threads, progress=False)
    fast = mixqrt.Pipeline(a.target, threads=a.threads, progress=False, lookup=a.lookup)
    for p in (plain, fast):
        p.configure_engine(kv_cache_bytes=0)
        run(p, {"messages": "Hello", "source": ""}, 4)
    tok = plain.tokenizer
    servers = {}
    if a.llama_server_gguf:       # started once; each prompt runs on them right after mixqrt's runs
        import contextlib

        from _llama_server import start_llama_server
        from speculative import LLAMA_SPEC
        stack = contextlib.ExitStack()
        for label in (["plain"] if a.llama_plain else []) + a.llama_spec.split(","):
            srv = stack.enter_context(start_llama_server(f"llama-server-{label}", a.llama_server_gguf, a.threads,
                                                         4096, Path("/tmp/apply-edits-llama"), extra=LLAMA_SPEC[label]))
            servers[label] = srv.wait_ready()
            complete_ids(srv.url, [1, 2, 3], 4)                  # warm-up
    results = []
    for it in items:
        n_src = len(tok.encode(it["source"]))
        max_tokens = int(n_src * 1.5) + 64
        if a.max_new:
            max_tokens = min(max_tokens, a.max_new)
        base = run(plain, it, max_tokens)
        r = {"kind": it["kind"], "name": it["name"], "lines": it["lines"], "source_tokens": n_src,
             "prompt_ids": tok.encode_chat(it["messages"], add_generation_prompt=True),
             "max_tokens": max_tokens, "load_avg_1m": os.getloadavg()[0], "plain": base}
        settings = [("lookup", False)] + ([] if a.no_prediction else [("prediction", True)])
        for label, pred in settings:
            got = run(fast, it, max_tokens, prediction=pred)
            got["identical"] = got["tokens"] == base["tokens"]
            got["speedup"] = got["decode_tps"] / max(1e-9, base["decode_tps"])
            r[label] = got
        if servers:
            ids = r["prompt_ids"]
            for label, srv in servers.items():
                got = complete_ids(srv.url, ids, max_tokens)
                t = got.get("timings", {})
                r[f"llama {label}"] = {"decode_tps": t.get("predicted_per_second", 0.0), "n": t.get("predicted_n"),
                                       "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                                       "tokens": got.get("tokens") or []}
            lp = r["llama plain"]["tokens"] if "plain" in servers else None
            for label in servers:
                toks = r[f"llama {label}"].pop("tokens")
                if lp is not None:
                    r[f"llama {label}"]["identical_to_its_plain"] = toks == lp
        print({"kind": r["kind"], "name": r["name"], "n": base["n"], "plain": round(base["decode_tps"], 1),
               **{k: (round(r[k]["speedup"], 2), r[k]["identical"], f"{r[k]['accepted']}/{r[k]['drafted']}")
                  for k, _ in settings}, "load": round(r["load_avg_1m"], 2),
               **{k: round(v["decode_tps"], 1) for k, v in r.items() if k.startswith("llama ")}}, flush=True)
        results.append(r)
    free = []
    if a.free:
        from speculative import FREE
        for q in [FREE[0]] + [[{"role": "user", "content": q}] for q in FREE[1:]]:
            it = {"messages": q, "source": ""}
            base = run(plain, it, 160)
            got = run(fast, it, 160)
            free.append({"prompt": q if isinstance(q, str) else q[0]["content"], "plain": base, "lookup": got,
                         "identical": got["tokens"] == base["tokens"],
                         "speedup": got["decode_tps"] / max(1e-9, base["decode_tps"]),
                         "load_avg_1m": os.getloadavg()[0]})
            print("free", round(free[-1]["speedup"], 2), free[-1]["identical"], flush=True)
    if servers:
        stack.close()
    for r in results:
        for k in ("lookup", "prediction"):
            if k in r:
                r[k].pop("tokens")       # identical to plain's, or not (r[k]["identical"])
    for f in free:
        f["plain"].pop("tokens")
        f["lookup"].pop("tokens")
    for p in (plain, fast):
        p.close()
    res = {"machine": machine_info(), "target": a.target, "threads": a.threads, "lookup": a.lookup,
           "results": results, "free": free, "llama_server_gguf": a.llama_server_gguf,
           "command": " ".join(["python"] + sys.argv)}
    suffix = "" if a.part == "1/1" else "-" + a.part.replace("/", "of")
    write_json(ROOT / "docs" / "data" / f"{a.tag}{suffix}.json", res)


def _by_kind(rows):
    """(label, the rows of that kind) per kind present, then ("**all**", every row)."""
    for kind in KINDS + ("all",):
        rs = [r for r in rows if kind in ("all", r["kind"])]
        if rs:
            yield ("**all**" if kind == "all" else kind), rs


def write_doc(tag: str):
    """The per-kind table (and the llama.cpp one, where the runs had it) from every saved part."""
    parts = sorted((ROOT / "docs" / "data").glob(f"{tag}*.json"))
    runs = [json.loads(p.read_text()) for p in parts]
    med = statistics.median
    rows = [r for res in runs for r in res["results"]]
    loads = [r["load_avg_1m"] for r in rows]
    lines = [f"- command{'s' if len(runs) > 1 else ''}: " + "; ".join(f"`{res['command']}`" for res in runs),
             f"- machine: {runs[0]['machine'].get('cpu_model', '')}, ISA tier {runs[0]['machine'].get('isa', '')}, 2 threads; load average (1 min) during the runs "
             f"{min(loads):.1f}-{max(loads):.1f}", "",
             "Per prompt, in one process and in alternation: plain greedy decoding, the copy drafter (`lookup="
             f"{runs[0]['lookup']}`) and the copy drafter with `prediction` = the original function. Speed-up = the "
             "prompt's decode tok/s (after the first token) over plain's, then min / median over the kind's "
             "prompts; identical = the output equals plain decoding's token for token; mean draft = drafted "
             "tokens per verify step.", "",
             "| kind | prompts | lines | output tokens (median) | plain tok/s | copy drafter: speed-up min / median | "
             "identical | accepted / drafted | mean draft | with `prediction`: min / median | identical | mean draft |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    for label, rs in _by_kind(rows):
        lk = [r["lookup"] for r in rs]
        pr = [r["prediction"] for r in rs if "prediction" in r]

        def cols(xs):
            d, acc, st = (sum(x[k] for x in xs) for k in ("drafted", "accepted", "verify_steps"))
            return (f"{min(x['speedup'] for x in xs):.2f}x / {med(x['speedup'] for x in xs):.2f}x | "
                    f"{sum(x['identical'] for x in xs)}/{len(xs)}", f"{acc}/{d} ({acc / max(1, d):.0%})",
                    f"{d / max(1, st):.1f}")
        a1, a2, a3 = cols(lk)
        p1, _, p3 = cols(pr) if pr else ("| ", "", "")
        lines.append(f"| {label} | {len(rs)} | {min(r['lines'] for r in rs)}-"
                     f"{max(r['lines'] for r in rs)} | {med(r['plain']['n'] for r in rs):.0f} | "
                     f"{med(r['plain']['decode_tps'] for r in rs):.1f} | {a1} | {a2} | {a3} | {p1} | {p3} |")
    lrows = [r for r in rows if any(k.startswith("llama ") and k != "llama plain" for k in r)]
    loads = loads or [0.0]
    if lrows:
        spec = next(k for k in lrows[0] if k.startswith("llama ") and k != "llama plain")
        lines += ["", f"llama.cpp's llama-server on `{Path(runs[0]['llama_server_gguf']).name}` (the same weights; "
                  f"one slot, greedy, the same token-id prompts, right after mixqrt's runs of each prompt), "
                  f"`{spec[6:]}`, its own timings; mixqrt / llama.cpp = the copy drafter's decode tok/s over "
                  f"llama.cpp's n-gram lookup's on the same prompt (min / median):", "",
                  f"| kind | llama.cpp {spec[6:]} tok/s | its accepted / drafted | mixqrt plain tok/s | "
                  "mixqrt copy tok/s | mixqrt copy / llama.cpp (min / median) | with `prediction` / llama.cpp |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for label, rs in _by_kind(lrows):
            ls = [r[spec] for r in rs]
            ratio = [r["lookup"]["decode_tps"] / max(1e-9, r[spec]["decode_tps"]) for r in rs]
            pratio = [r["prediction"]["decode_tps"] / max(1e-9, r[spec]["decode_tps"]) for r in rs if "prediction" in r]
            lines.append(
                f"| {label} | {med(x['decode_tps'] for x in ls):.1f} | "
                f"{sum(x['accepted'] for x in ls)}/{sum(x['drafted'] for x in ls)} | "
                f"{med(r['plain']['decode_tps'] for r in rs):.1f} | "
                f"{med(r['lookup']['decode_tps'] for r in rs):.1f} | {min(ratio):.2f}x / {med(ratio):.2f}x | "
                + (f"{min(pratio):.2f}x / {med(pratio):.2f}x |" if pratio else " |"))
    free = [f for res in runs for f in res.get("free") or []]
    if free:
        lines += ["", "Free generation (benchmarks/speculative.py's free prompts, at most 160 tokens), plain against "
                  "the copy drafter: speed-up min / median "
                  f"{min(f['speedup'] for f in free):.2f}x / {med(f['speedup'] for f in free):.2f}x, identical "
                  f"{sum(f['identical'] for f in free)}/{len(free)}, drafts accepted "
                  f"{sum(f['lookup']['accepted'] for f in free)}/{sum(f['lookup']['drafted'] for f in free)}."]
    update_doc(ROOT / "docs" / "speculative.md", {tag: "\n".join(lines)})


if __name__ == "__main__":
    main()
