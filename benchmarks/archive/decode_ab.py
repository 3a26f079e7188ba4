"""End-to-end decode A/B of the two decode defaults, on one model, in one process: writes docs/lab/decode-ab.md.

    python benchmarks/decode_ab.py MODEL [--gguf LLAMA_CPP.gguf ...] [--threads 1,2] [--tokens 16] [--rounds 4]
                                   [--out docs/lab/decode-ab.md]

Variants, alternated round by round so that machine noise hits them alike (best round per variant):
- `lean`       the default: AVX-512 lean decode path for q3p/q3u/q6, pool workers futex-sleep between
               products
- `lean+hot`   lean path, pool in hot mode for each decode step (`models.qwen2.HOT_MAX_T = 16`, opt-in)
- `unpack`     the generic AVX-512 unpack path (`_ops.set_lean_mv(False)`): decode before the lean path
- `unpack+hot` unpack path, hot steps

With `--gguf` (llama-cpp-python installed), each llama.cpp file joins the rotation: the same
64-token prompt, then `tokens` single-token evals at the same thread count (its KV cache trimmed back
to the prompt each round, like mixqrt's), so both runtimes decode side by side in one process.

Each round: `tokens` greedy single-token steps after a 64-token prefill, cache trimmed back so every
round decodes at the same positions. Also reports the read bandwidth (best of 3 probes) and the bytes a
decode step reads, so each variant's ratio to the bandwidth bound is comparable.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the source tree
from benchmarks._common import ROOT, gguf_decode_bytes, provenance  # noqa: E402

VARIANTS = [("lean", True, False), ("lean+hot", True, True), ("unpack", False, False), ("unpack+hot", False, True)]
DEFAULT = "lean"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help="subset of the variants")
    ap.add_argument("--gguf", action="append", default=[], help="llama.cpp GGUF to alternate with (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "lab" / "decode-ab.md"))
    a = ap.parse_args(argv)
    variants = [v for v in VARIANTS if v[0] in a.variants.split(",")]
    if not any(v[0] == DEFAULT for v in variants):
        ap.error(f"--variants must include {DEFAULT} (the default, the reference column)")

    import mixqrt
    from mixqrt import ops
    from mixqrt.platform import isa
    from mixqrt._kernels import _ops
    from mixqrt.commands.bench import decode_bytes_per_token, honest_bound, measure_bandwidth
    from mixqrt.models import qwen2

    loaded = mixqrt.load(a.model)
    model = loaded.model
    prompt = np.random.default_rng(0).integers(100, 30000, size=64)
    bpt = decode_bytes_per_token(model, 64 + a.tokens // 2)
    lean_before, hot_max = _ops.set_lean_mv(None), qwen2.HOT_MAX_T
    rows = []
    for nt in [int(t) for t in a.threads.split(",") if t]:
        ops.set_num_threads(nt)
        bw = measure_bandwidth(nt)
        cache = model.make_cache(64 + a.tokens + 8)
        model(prompt, cache, 0, last_only=True)
        best = {}
        lcpp = []
        for g in a.gguf:
            from llama_cpp import Llama
            llm = Llama(model_path=g, n_ctx=64 + a.tokens + 8, n_threads=nt, n_threads_batch=nt, n_batch=64,
                        use_mmap=True, verbose=False)
            llm.eval(prompt.tolist())
            lcpp.append((f"llama.cpp {os.path.basename(g)}", llm))
        for _ in range(a.rounds):
            for name, llm in lcpp:
                llm._ctx.kv_cache_seq_rm(-1, 64, -1)
                llm.n_tokens = 64
                t = time.perf_counter()
                for _ in range(a.tokens):
                    llm.eval([1000])
                best[name] = max(best.get(name, 0.0), a.tokens / (time.perf_counter() - t))
                print(f"t{nt} {name}: {a.tokens / (time.perf_counter() - t):.2f} tok/s", flush=True)
            for name, lean, hot in variants:
                _ops.set_lean_mv(lean)
                qwen2.HOT_MAX_T = 16 if hot else 0
                cache.trim(cache.offset - 64)                  # back to the end of the prompt
                tok = 1000
                t = time.perf_counter()
                for _ in range(a.tokens):
                    tok = int(np.argmax(model(np.array([tok]), cache, None, last_only=True)))
                best[name] = max(best.get(name, 0.0), a.tokens / (time.perf_counter() - t))
                print(f"t{nt} {name}: {a.tokens / (time.perf_counter() - t):.2f} tok/s", flush=True)
        for _, llm in lcpp:
            llm.close() if hasattr(llm, "close") else None
        bw = max(bw, measure_bandwidth(nt))
        # honest bound: the probe, or the best effective rate any variant or llama.cpp reached here
        rates = [best[n] * bpt for n, _, _ in variants if n in best]
        rates += [best[n] * gguf_decode_bytes(g) for (n, _), g in zip(lcpp, a.gguf) if n in best]
        bw, note = honest_bound(bw, rates)
        if note:
            print(f"t{nt}: NOTE {note}", flush=True)
        rows.append((nt, bw, best, [n for n, _ in lcpp]))
    _ops.set_lean_mv(lean_before)
    qwen2.HOT_MAX_T = hot_max

    L = ["# Decode A/B: lean kernels and hot decode steps", "",
         "Generated by `benchmarks/decode_ab.py` (one process, variants alternated round by round, best "
         "round per variant; a slow round on the shared machine can only lower a variant's best).", "",
         provenance(f"python benchmarks/decode_ab.py {a.model} --threads {a.threads} --tokens {a.tokens} "
                    f"--rounds {a.rounds} --variants {a.variants}" + "".join(f" --gguf {g}" for g in a.gguf)),
         f"- model: `{os.path.basename(a.model)}`, {loaded.nbytes / 1e9:.2f} GB, {bpt / 1e9:.3f} GB read per "
         f"decode step; ISA tier `{isa.current()}`", "",
         "| threads | read bandwidth | bound tok/s | " + " | ".join(f"`{n}` tok/s | `{n}` ratio" for n, _, _ in variants)
         + " |",
         "|" + "---|" * (3 + 2 * len(variants))]
    for nt, bw, best, _ in rows:
        cells = []
        for name, _, _ in variants:
            cells += [f"{best[name]:.2f}", f"{best[name] * bpt / bw:.2f}"]
        L.append(f"| {nt} | {bw / 1e9:.1f} GB/s | {bw / bpt:.2f} | " + " | ".join(cells) + " |")
    L += ["", f"`{DEFAULT}` is the default; `unpack` is decode as it ran before the lean path. "
          "Ratio = tok/s x bytes per step / read bandwidth.", ""]
    if a.gguf:
        gb = {os.path.basename(g): gguf_decode_bytes(g) for g in a.gguf}
        L += ["## Side by side with llama.cpp", "",
              "The same rounds, alternated with the mixqrt variants above. llama.cpp's bytes per step = every "
              "tensor of the GGUF but token_embd (the rule used for mixqrt); ratio against the same bandwidth.", "",
              "| threads | runtime | bytes/step | decode tok/s | ratio | vs mixqrt default |", "|---|---|---|---|---|---|"]
        for nt, bw, best, names in rows:
            L.append(f"| {nt} | mixqrt `{DEFAULT}` | {bpt / 1e9:.3f} GB | {best[DEFAULT]:.2f} | "
                     f"{best[DEFAULT] * bpt / bw:.2f} | 1.00x |")
            for n in names:
                b = gb[n.split(" ", 1)[1]]
                L.append(f"| {nt} | {n} | {b / 1e9:.3f} GB | {best[n]:.2f} | {best[n] * b / bw:.2f} | "
                         f"{best[DEFAULT] / best[n]:.2f}x |")
        L += ["", "`vs mixqrt default` = mixqrt's tok/s / that runtime's tok/s (above 1: mixqrt is faster).", ""]
    with open(a.out, "w") as f:
        f.write("\n".join(L))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
