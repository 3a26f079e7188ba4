"""What a KV cache type costs in quality at depth (issue 41): KL divergence on long WikiText-2 windows
and the pass-key retrieval check. Works for every mixqrt KV type (mixqrt.models.kv_cache.KV_TYPES).

    python benchmarks/kv_quality.py kl --ctx 8192,16384 --kv-types f16,q8,q4 --lock LOCKFILE
    python benchmarks/kv_quality.py passkey --lengths 4096,8192,16384,28672 --kv-types f32,f16,q4
    python benchmarks/kv_quality.py report

kl: WikiText-2 (test) in windows of --ctx tokens, the second half of each scored as llama-perplexity
does. mixqrt: `mixqrt ppl --kv-type f32 --save-logits` once per window size, then `mixqrt ppl
--kv-type T --kl-base` for each type (same file, same windows). llama.cpp: `llama-perplexity
--kl-divergence-base` with its f16 K/V cache, then `--kl-divergence` with the q8_0/q8_0 cache (its
Q4_0 file, -fa on: a quantized V cache needs it), on the same text and windows. Each run is one child
process; its JSON (or llama-perplexity's log) is kept in docs/data/long_context/ and not run again.

passkey: a planted fact, "The pass key is NNNNN. Remember it. NNNNN is the pass key.", at 10 depths
(0 %, 10 %, ... 90 % of the filler) of a prompt of about L tokens of filler text, then the question;
greedy, 8 new tokens, one Engine per KV type (prompts in descending key depth: the prompt cache reuses
the shared prefix). The answer of each type is compared with f32 K/V's and with the key.

Both write their tables into docs/long-context.md (mixqrt:long-context-kl, -passkey).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, llama_cpp_bin, provenance, update_doc  # noqa: E402
from long_context import DATA, DOC, SRC, Lock, child_env, code_commit, loadavg, measured, prepare_ggufs  # noqa: E402

TEXT = ROOT / "tests" / "data" / "wikitext-2-test.txt"


def default_mxq() -> str:
    from long_context import default_mxq as d
    return d()


# ----------------------------------------------------------------------------------- KL
def kl_file(system: str, kv: str, ctx: int) -> Path:
    return DATA / f"kl-{system}-{kv}-c{ctx}.json"


def run_child(cmd, lock, out: Path, parse) -> dict:
    with lock:
        before, t = loadavg(), time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=SRC["dir"], env=child_env())
        after = loadavg()
    rec = {"command": shlex.join(cmd), "loadavg_before": before, "loadavg_after": after,
           "seconds": round(time.time() - t, 1), "returncode": r.returncode, "code": code_commit()}
    if r.returncode == 0:
        rec["result"] = parse(r)
    else:
        rec["error"] = (r.stderr or r.stdout)[-3000:]
    DATA.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"{out.name}: {'ok' if r.returncode == 0 else 'FAILED'} ({rec['seconds']} s, load {before} -> {after})",
          file=sys.stderr, flush=True)
    return rec


def _mixqrt_json(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


def _lcpp_kl(r) -> dict:
    """llama-perplexity --kl-divergence's summary lines -> numbers."""
    text = r.stdout + r.stderr
    out = {}
    for key, pat in (("kld_mean", r"Mean\s+KLD:\s+([-\d.e+]+)"), ("kld_p99", r"99\.0%\s+KLD:\s+([-\d.e+]+)"),
                     ("same_top_pct", r"Same top p:\s+([\d.]+)"), ("ppl", r"Mean\s+PPL\(Q\)\s*:\s+([\d.]+)"),
                     ("ppl_base", r"Mean\s+PPL\(base\)\s*:\s+([\d.]+)")):
        m = re.search(pat, text)
        if m:
            out[key] = float(m.group(1))
    if "kld_mean" not in out:
        raise SystemExit(f"no KLD in llama-perplexity's output: {text[-2000:]}")
    return out


def _lcpp_ppl(r) -> dict:
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", r.stdout + r.stderr)
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2))} if m else {}


def cmd_kl(a) -> None:
    lock = Lock(a.lock)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    mxq = a.mxq or (None if a.skip_mixqrt else default_mxq())
    for ctx in (int(c) for c in a.ctx.split(",")):
        common = ["--text", a.text, "--ctx", str(ctx), "--chunks", str(a.chunks), "-t", str(a.threads), "--json", "-q"]
        base = work / f"mixqrt-f32-c{ctx}-n{a.chunks}.logp"
        if not a.skip_mixqrt:
            if not base.exists() or not measured(kl_file("mixqrt", "f32", ctx)):
                run_child([sys.executable, "-m", "mixqrt", "ppl", mxq, "--kv-type", "f32", "--save-logits", str(base)]
                          + common, lock, kl_file("mixqrt", "f32", ctx), _mixqrt_json)
            for kv in a.kv_types.split(","):
                if kv != "f32" and (a.fresh or not measured(kl_file("mixqrt", kv, ctx))):
                    run_child([sys.executable, "-m", "mixqrt", "ppl", mxq, "--kv-type", kv, "--kl-base", str(base)]
                              + common, lock, kl_file("mixqrt", kv, ctx), _mixqrt_json)
        if not a.skip_llamacpp:
            from mixqrt.testing import model_path
            gguf = prepare_ggufs(Path(model_path("qwen")), Path(a.gguf_dir), [a.lcpp_type])[a.lcpp_type]
            lbase = work / f"llamacpp-{a.lcpp_type}-f16-c{ctx}-n{a.chunks}.kld"
            lp = [str(llama_cpp_bin("llama-perplexity")), "-m", str(gguf), "-f", a.text, "-c", str(ctx), "-b", str(ctx),
                  "--chunks", str(a.chunks), "-t", str(a.threads), "-fa", "on"]
            if not lbase.exists() or not measured(kl_file("llamacpp", "f16", ctx)):
                run_child(lp + ["-ctk", "f16", "-ctv", "f16", "--kl-divergence-base", str(lbase)], lock,
                          kl_file("llamacpp", "f16", ctx), _lcpp_ppl)
            if a.fresh or not measured(kl_file("llamacpp", "q8_0", ctx)):
                run_child(lp + ["-ctk", "q8_0", "-ctv", "q8_0", "--kl-divergence-base", str(lbase), "--kl-divergence"],
                          lock, kl_file("llamacpp", "q8_0", ctx), _lcpp_kl)
    report_kl(a)


def report_kl(a) -> None:
    rows = ["| window | system | KV cache | against | bits per value | mean KL | KL p99 | same top % | PPL | load before/after "
            "| mixqrt code |", "|---:|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    bits = {"f32": 32, "f16": 16, "q8_0": 8.5}
    for p in sorted(DATA.glob("kl-*-c*.json"), key=lambda p: (int(p.stem.rsplit("-c", 1)[1]), p.stem)):
        system, kv = p.stem.split("-")[1:3]
        ctx = int(p.stem.rsplit("-c", 1)[1])
        rec = json.loads(p.read_text())
        r = rec.get("result") or {}
        if not r:
            continue
        base = "its f32 K/V" if system == "mixqrt" else "its f16 K/V"
        if (system, kv) in (("mixqrt", "f32"), ("llamacpp", "f16")):
            base = "(the base)"
        b = r.get("kv_bits_per_value") or bits.get(kv)
        kl = f"{r['kld_mean']:.6f}" if r.get("kld_mean") is not None else "-"
        p99 = f"{r['kld_p99']:.5f}" if r.get("kld_p99") is not None else "-"
        same = f"{r['same_top_pct']:.2f}" if r.get("same_top_pct") is not None else "-"
        ppl = f"{r['ppl']:.3f}" if r.get("ppl") is not None else "-"
        name = "mixqrt (q4a file)" if system == "mixqrt" else "llama.cpp (Q4_0 file)"
        rows.append(f"| {ctx:,d} | {name} | {kv} | {base} | {b if b is not None else '-'} | {kl} | {p99} | {same} | "
                    f"{ppl} | {rec['loadavg_before'].split()[0]}/{rec['loadavg_after'].split()[0]} | "
                    f"{rec.get('code', '-') if system == 'mixqrt' else '-'} |")
    prov = provenance("python benchmarks/kv_quality.py " + " ".join(sys.argv[1:]))
    prov += (f"- WikiText-2 test, the first {a.chunks} window(s) of each size, the second half of each scored "
             f"(llama-perplexity's method); KL(base || type) per scored position, averaged; each row's command is "
             f"in docs/data/long_context/kl-*.json (not timed: the runs may go niced outside the benchmark lock)\n")
    update_doc(DOC, {"long-context-kl": prov + "\n" + "\n".join(rows)}, "Long context")


# ----------------------------------------------------------------------------------- pass key
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n\n")
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tok, length: int, frac: float, key: int) -> list[int]:
    """~length tokens: the intro, filler with the fact at `frac` of it, the question."""
    unit = tok.encode(FILLER, add_special_tokens=False)
    head = tok.encode(INTRO, add_special_tokens=False)
    fact = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)
    tail = tok.encode(QUESTION, add_special_tokens=False)
    n_units = max(1, (length - len(head) - len(fact) - len(tail)) // len(unit))
    at = int(round(frac * n_units))
    return head + unit * at + fact + unit * (n_units - at) + tail


def cmd_passkey(a) -> None:
    import numpy as np

    from mixqrt.generation.engine import Engine
    from mixqrt.pipeline import LoadedModel
    lengths = [int(x) for x in a.lengths.split(",")]
    fracs = [i / a.positions for i in range(a.positions)]
    rng = np.random.default_rng(a.seed)
    keys = {(L, f): int(rng.integers(10000, 100000)) for L in lengths for f in fracs}
    lm = LoadedModel(a.mxq or default_mxq(), threads=a.threads)
    tok = lm.tokenizer
    out = DATA / "passkey.json"
    res = json.loads(out.read_text()) if out.exists() else {}
    for kv in a.kv_types.split(","):
        for L in lengths:
            tag = f"{kv}:{L}"
            if tag in res and not a.fresh:
                continue
            with Lock(a.lock):
                before, t0 = loadavg(), time.time()
                eng = Engine(lm, kv_type=kv, max_slots=1, kv_cache_bytes=a.kv_cache_bytes)
                answers = []
                try:
                    for f in sorted(fracs, reverse=True):          # deepest key first: the next prompt shares its prefix
                        ids = passkey_prompt(tok, L, f, keys[(L, f)])
                        pieces = list(eng.submit(ids, max_new_tokens=8, temperature=0.0))
                        text = "".join(p.text for p in pieces)
                        m = re.search(r"\d+", text)
                        answers.append({"frac": f, "key": keys[(L, f)], "tokens": len(ids), "text": text,
                                        "answer": int(m.group()) if m else None,
                                        "cached_tokens": pieces[-1].cached_tokens})
                finally:
                    eng.close()
                after = loadavg()
            res[tag] = {"kv_type": kv, "length": L, "answers": sorted(answers, key=lambda x: x["frac"]),
                        "loadavg_before": before, "loadavg_after": after, "seconds": round(time.time() - t0, 1)}
            ok = sum(x["answer"] == x["key"] for x in answers)
            print(f"passkey {kv} {L}: {ok}/{len(answers)} correct ({res[tag]['seconds']} s)", file=sys.stderr, flush=True)
            DATA.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1) + "\n")
    report_passkey(a)


def report_passkey(a) -> None:
    out = DATA / "passkey.json"
    if not out.exists():
        return
    res = json.loads(out.read_text())
    rows = ["| prompt tokens | KV cache | correct (of the depths) | same answer as f32 | answers at 0 %, 10 %, ... 90 % depth "
            "| load before/after |", "|---:|---|---:|---:|---|---|"]
    for tag, r in sorted(res.items(), key=lambda x: (x[1]["length"], x[1]["kv_type"])):
        ref = res.get(f"f32:{r['length']}")
        ans = [x["answer"] for x in r["answers"]]
        ok = sum(x["answer"] == x["key"] for x in r["answers"])
        same_keys = ref is not None and [x["key"] for x in r["answers"]] == [z["key"] for z in ref["answers"]]
        same = (f"{sum(x == y for x, y in zip(ans, [z['answer'] for z in ref['answers']]))}/{len(ans)}"
                if same_keys else "-" if ref is None else "other keys")
        marks = " ".join("✓" if x["answer"] == x["key"] else str(x["answer"]) for x in r["answers"])
        rows.append(f"| {r['answers'][0]['tokens']:,d} | {r['kv_type']} | {ok}/{len(ans)} | {same} | {marks} | "
                    f"{r['loadavg_before'].split()[0]}/{r['loadavg_after'].split()[0]} |")
    prov = provenance("python benchmarks/kv_quality.py " + " ".join(sys.argv[1:]))
    prov += "- ✓: the model answered the planted key; otherwise its answer (None: no number)\n"
    update_doc(DOC, {"long-context-passkey": prov + "\n" + "\n".join(rows)}, "Long context")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kl")
    k.add_argument("--ctx", default="8192,16384")
    k.add_argument("--chunks", type=int, default=1, help="windows of each size (default 1)")
    k.add_argument("--kv-types", default="f16", help="mixqrt types compared with its f32 K/V")
    k.add_argument("--lcpp-type", default="Q4_0")
    k.add_argument("--text", default=str(TEXT))
    k.add_argument("--work", default="/tmp/longctx-kl", help="where the base log-probs go (GBs)")
    k.add_argument("--skip-mixqrt", action="store_true")
    k.add_argument("--skip-llamacpp", action="store_true")
    k.set_defaults(fn=cmd_kl)
    s = sub.add_parser("passkey")
    s.add_argument("--lengths", default="4096,8192,16384,28672",
                   help="prompt lengths; the planted keys are drawn in this list's order (--seed), so two KV "
                        "types compare only when run with the same list (the report checks the keys)")
    s.add_argument("--positions", type=int, default=10)
    s.add_argument("--kv-types", default="f32,f16")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--kv-cache-bytes", type=int, default=4 << 30)
    s.set_defaults(fn=cmd_passkey)
    r = sub.add_parser("report")
    r.add_argument("--chunks", type=int, default=1)
    r.set_defaults(fn=lambda a: (report_kl(a), report_passkey(a)))
    for x in (k, s, r):
        x.add_argument("--mxq", default=None)
        x.add_argument("--gguf-dir", default="/tmp/longctx-lcpp")
        x.add_argument("-t", "--threads", type=int, default=2)
        x.add_argument("--lock", default=None, metavar="FILE")
        x.add_argument("--fresh", action="store_true")
        x.add_argument("--src", default=None, metavar="DIR",
                       help="the mixqrt source tree (a built checkout) the mixqrt runs use (default: this one)")
    a = p.parse_args()
    if a.src:
        SRC["dir"] = str(Path(a.src).resolve())
        sys.path.insert(0, SRC["dir"])          # passkey runs in this process
        for m in [m for m in sys.modules if m == "mixqrt" or m.startswith("mixqrt.")]:
            del sys.modules[m]
    a.fn(a)


if __name__ == "__main__":
    main()
