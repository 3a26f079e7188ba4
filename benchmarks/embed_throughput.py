"""Embedding throughput: 1,000 inputs of mixed lengths, mixqrt (Pipeline.embed: packed forwards on the
engine thread) against llama.cpp's embedding mode (llama-cpp-python's Llama.embed: sequences packed into
n_batch = 2048-token batches, up to its parallel-sequence limit) on the same GGUF, last-token pooling,
L2-normalized, 2 threads each; and mixqrt's own prefill of one 2,048-token prompt for scale.
A/B alternated in one process (--rounds, default 1); tokens/s = input tokens / wall seconds.

The inputs: the first 1,000 sentences (lines split at " . ") of tests/data/wikitext-2-test.txt, headings
left out, of 5-32 tokens each (retrieval-chunk sized; their lengths are printed).

    LLAMA_CPP_LIB_PATH=/work/llama/build/bin PYTHONPATH=/work/llama/src/llama_cpp_python-0.3.36 \\
        flock /work/bench.lock python benchmarks/embed_throughput.py \\
        --gguf ~/.cache/mixqrt/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --json docs/data/embed-throughput.json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N_INPUTS = 1000
MAX_LEN = 32


def inputs(tokenizer, n: int = N_INPUTS) -> list[str]:
    out = []
    for line in (ROOT / "tests" / "data" / "wikitext-2-test.txt").read_text(encoding="utf-8").split("\n"):
        if not line.strip() or line.strip().startswith("="):
            continue
        for sent in line.strip().split(" . "):
            s = sent.strip()
            k = len(tokenizer.encode(s, parse_special=False))
            if 5 <= k <= MAX_LEN:
                out.append(s)
            if len(out) == n:
                return out
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import llama_cpp
    from llama_cpp import Llama

    import mixqrt
    from mixqrt import ops
    pipe = mixqrt.Pipeline(a.gguf, threads=a.threads, progress=False)
    texts = inputs(pipe.tokenizer)
    seqs = pipe.embed_ids(texts)
    lens = [len(s) for s in seqs]
    n_tok = sum(lens)
    print(f"{len(texts)} inputs, {n_tok} tokens (min {min(lens)}, median {statistics.median(lens)}, max {max(lens)})",
          flush=True)
    llm = Llama(model_path=a.gguf, embedding=True, n_ctx=2048, n_batch=2048, n_ubatch=2048, n_threads=a.threads,
                n_threads_batch=a.threads, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST, verbose=False)
    emb = pipe.embedder(pooling="last")
    prompt = np.asarray((seqs[0] * 2048)[:2048], dtype=np.int64)
    load0 = os.getloadavg()
    res = {"mixqrt_embed": [], "llamacpp_embed": [], "mixqrt_prefill_2048": []}
    vm = vl = None
    for r in range(a.rounds):
        t = time.perf_counter()
        vl = np.asarray(llm.embed(texts, normalize=True), dtype=np.float32)
        res["llamacpp_embed"].append(n_tok / (time.perf_counter() - t))
        t = time.perf_counter()
        vm = pipe.engine.embed(seqs, emb).result()
        res["mixqrt_embed"].append(n_tok / (time.perf_counter() - t))
        cache = pipe.model.make_cache(2048)
        t = time.perf_counter()
        pipe.model(prompt, cache, last_only=True, chunk_size=2048)
        res["mixqrt_prefill_2048"].append(2048 / (time.perf_counter() - t))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in res.items()), flush=True)
    load1 = os.getloadavg()
    cos = (vm * vl).sum(-1)
    out = {k: statistics.median(v) for k, v in res.items()}
    print("median: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in out.items()))
    print(f"mixqrt / llama.cpp embed {out['mixqrt_embed'] / out['llamacpp_embed']:.2f}x; mixqrt embed / its 2048-token "
          f"prefill {out['mixqrt_embed'] / out['mixqrt_prefill_2048']:.2f}; cosine mixqrt (q4a) vs llama.cpp "
          f"(Q4_K_M): median {np.median(cos):.4f}, min {cos.min():.4f}; load {load0[0]:.2f} -> {load1[0]:.2f}")
    ops.prefetch_wait()
    if a.json:
        from mixqrt.io.atomic import atomic_write
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gguf": Path(a.gguf).name,
               "threads": a.threads, "inputs": len(texts), "tokens": n_tok, "lengths": {"min": min(lens),
               "median": statistics.median(lens), "max": max(lens)}, "rounds": res, "median": out,
               "cosine_median": float(np.median(cos)), "cosine_min": float(cos.min()),
               "load_before": load0, "load_after": load1}
        with atomic_write(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
