"""8 concurrent requests with a JSON schema against 8 unconstrained ones: aggregate decode tok/s.

    python benchmarks/structured_throughput.py --model M.mxq [--clients 8] [--tokens 96] [--rounds 2] [--docs]

Both kinds run the same prompts through one Engine (max_slots = clients) and generate exactly
--tokens tokens each: the unconstrained requests with eos off, the constrained ones under a schema
that cannot end sooner (an array of at least 20 small objects). The rounds alternate
(free, schema, free, schema, ...) so that a drifting machine load hits both alike. Aggregate tok/s =
generated tokens / seconds from the first submit to the last token. The engine's own counters give
the mask time per constrained token (computed on the masker thread while the forward runs).
Two rates: end to end (first submit to last token: prefill and the grammar's compile included) and
while all decode (tokens between the last request's first token and the first request's last).
--docs writes the table into docs/structured-output.md (between its structured-throughput markers).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import read_concurrently, window_rates  # noqa: E402

SCHEMA = {"type": "array", "minItems": 20, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "name": {"type": "string", "maxLength": 12},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}
TOPICS = ["fruits", "cities", "planets", "rivers", "composers", "birds", "metals", "languages"]


def run_round(eng, tok, clients: int, tokens: int, constrained: bool) -> dict:
    reqs = []
    t0 = time.perf_counter()
    for i in range(clients):
        msgs = [{"role": "user", "content": f"List {TOPICS[i % len(TOPICS)]} as JSON objects with id, name and ok."}]
        ids = tok.encode_chat(msgs)
        kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}) \
            if constrained else dict(eos_token_ids=[])
        reqs.append(eng.submit(ids, max_new_tokens=tokens, **kw))
    r = window_rates(read_concurrently(reqs), t0)
    return {"tokens": r["tokens"], "seconds": r["tokens"] / r["e2e_tps"], "tok_s": r["e2e_tps"],
            "decode_tok_s": r["decode_tps"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help=".mxq file (e.g. the Qwen2.5 0.5B)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args(argv)
    from mixqrt.generation.engine import Engine
    from mixqrt.pipeline import LoadedModel
    lm = LoadedModel(a.model)
    eng = Engine(lm, max_slots=a.clients, kv_cache_bytes=0)
    tok = lm.tokenizer
    # warm up: the grammar's tokenizer adapter (seconds, once per model) and the kernels
    run_round(eng, tok, 1, 4, True)
    res = {"free": [], "schema": []}
    masks0 = eng.stats()
    for _ in range(a.rounds):
        for kind in ("free", "schema"):
            r = run_round(eng, tok, a.clients, a.tokens, kind == "schema")
            res[kind].append(r)
            print(kind, f"{r['tok_s']:.1f} tok/s end to end ({r['tokens']} tokens in {r['seconds']:.1f} s), "
                  f"{r['decode_tok_s']:.1f} tok/s while all decode", flush=True)
    st = eng.stats()
    eng.close()
    n_masks = st["grammar_masks"] - masks0["grammar_masks"]
    mask_us = (st["grammar_mask_seconds"] - masks0["grammar_mask_seconds"]) / max(n_masks, 1) * 1e6
    rows = []
    for key, what in (("decode_tok_s", "while all decode"), ("tok_s", "end to end")):
        free = statistics.median(r[key] for r in res["free"])
        schema = statistics.median(r[key] for r in res["schema"])
        rows.append(f"| {a.clients} × {a.tokens} tokens, {what} | {free:.1f} | {schema:.1f} | {schema / free:.2f} |")
    table = ("| requests | unconstrained tok/s | JSON schema tok/s | ratio |\n|---|---|---|---|\n" + "\n".join(rows) +
             f"\n\nMask cost: {mask_us:.0f} µs per constrained token (mask and bias, on the masker thread, "
             "beside the forward).")
    print(table)
    if a.docs:
        from _common import provenance, update_doc, write_json
        cmd = f"python benchmarks/structured_throughput.py --model {Path(a.model).name} --clients {a.clients} " \
              f"--tokens {a.tokens} --rounds {a.rounds} --docs"
        body = table + f"\n\nMedian of {a.rounds} alternating rounds each.\n\n" + provenance(cmd)
        update_doc(ROOT / "docs/structured-output.md", {"structured-throughput": body}, "Structured output")
        write_json(ROOT / "docs/data/structured-throughput.json",
                   {"rounds": res, "mask_us_per_token": mask_us})


if __name__ == "__main__":
    main()
